"""Orbax model checkpoints (``model/checkpoint.py``): save/restore, shardings, atomicity, errors.

A small two-layer config keeps the abstract model cheap; parameters are random arrays saved with
``save_params`` (no eager model init), compared array by array after restore.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdsa.model import checkpoint as ckpt
from kdsa.model.config import LinearAttnConfig, get_preset
from kdsa.sharding.rules import layout_shardings

CONFIG = get_preset("tiny").replace(
    num_hidden_layers=2, attn_res_block_size=1, param_dtype="bfloat16",
    linear_attn_config=LinearAttnConfig(kda_layers=(1,), full_attn_layers=(2,), num_heads=2,
                                        head_dim=16, use_full_rank_gate=True,
                                        gate_lower_bound=-5.0))


def arrays(config, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in ckpt.flat_variables(nnx.state(ckpt.abstract_model(config))).items():
        a = rng.standard_normal(v.shape) if np.dtype(v.dtype).kind == "f" else \
            rng.integers(0, 255, v.shape)
        out[k] = np.asarray(a).astype(v.dtype)
    return out


def items(values: dict):
    return ((k, (lambda a=a: jnp.asarray(a))) for k, a in values.items())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    values = arrays(CONFIG, 0)
    path = ckpt.save_params(tmp_path_factory.mktemp("ck") / "model", CONFIG, items(values),
                            metadata={"note": "test"}, batch_bytes=64 << 10)
    return path, values


def flat_model(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v[...]) for k, v in ckpt.flat_variables(nnx.state(model)).items()}


def test_round_trip_restores_every_variable(saved):
    """Batched partial saves (64 KiB batches: many Orbax writes) restore bit for bit, into the
    model built from the stored config, with the metadata kept."""
    path, values = saved
    config, model = ckpt.load_model(path)
    assert config == CONFIG
    got = flat_model(model)
    assert sorted(got) == sorted(values)
    for k, a in values.items():
        assert got[k].dtype == a.dtype, k
        np.testing.assert_array_equal(got[k], a, err_msg=k)
    _, info = ckpt.read_info(path)
    assert info["note"] == "test" and info["format"] == ckpt.FORMAT_VERSION
    assert [p.name for p in path.parent.iterdir()] == ["model"]  # no temporaries left


def test_save_model_then_load_on_a_mesh(saved, tmp_path):
    """``save_model`` of a restored model gives the same checkpoint; restoring on an 8-device
    mesh places every variable by the train rules."""
    from kdsa.sharding.mesh import make_mesh
    from kdsa.sharding.rules import state_shardings

    path, values = saved
    _, model = ckpt.load_model(path)
    again = ckpt.save_model(tmp_path / "again", CONFIG, model)
    mesh = make_mesh("fsdp=2,expert=2,tensor=2")
    _, sharded = ckpt.load_model(again, layout_shardings(mesh, "train"))
    want = ckpt.flat_variables(state_shardings(nnx.state(sharded), mesh, "train"))
    for k, v in ckpt.flat_variables(nnx.state(sharded)).items():
        assert v[...].sharding == want[k], k
        np.testing.assert_array_equal(np.asarray(v[...]), values[k], err_msg=k)
    w1 = sharded.segments[1].layers[0].block_sparse_moe.experts.w1[...]
    assert w1.sharding.spec[1] == "expert" and len(w1.sharding.device_set) == 8


def test_interrupted_save_keeps_the_previous_checkpoint(saved, tmp_path):
    path, values = saved
    dst = tmp_path / "model"
    ckpt.save_params(dst, CONFIG, items(values))

    def failing():
        for i, item in enumerate(items(arrays(CONFIG, 1))):
            if i == 20:
                raise KeyboardInterrupt("simulated interruption")
            yield item

    with pytest.raises(KeyboardInterrupt):
        ckpt.save_params(dst, CONFIG, failing(), batch_bytes=1, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    _, model = ckpt.load_model(dst)
    k = next(iter(values))
    np.testing.assert_array_equal(flat_model(model)[k], values[k])


def test_wrong_parameters_are_refused_by_name(tmp_path):
    values = arrays(CONFIG, 2)
    key = "segments.0.layers.0.self_attn.q_proj.kernel"
    values[key] = values[key][:, :5]
    with pytest.raises(ckpt.CheckpointError, match=f"parameter {key}: got bfloat16"):
        ckpt.save_params(tmp_path / "bad", CONFIG, items(values))
    values = arrays(CONFIG, 2)
    del values[key]
    with pytest.raises(ckpt.CheckpointError, match="never given"):
        ckpt.save_params(tmp_path / "bad", CONFIG, items(values))
    assert not any(tmp_path.iterdir())


def test_save_refuses_existing_destinations(saved, tmp_path):
    """``save_params`` / ``save_model`` replace an existing kdsa folder only with
    ``overwrite=True``, and never an unrelated folder or a file (nothing is touched)."""
    path, values = saved
    dst = tmp_path / "model"
    ckpt.save_params(dst, CONFIG, items(values))
    before = sorted(p.name for p in dst.rglob("*"))
    _, model = ckpt.load_model(dst)
    with pytest.raises(ValueError,
                       match="already exists .a kdsa model folder.; pass --overwrite"):
        ckpt.save_model(dst, CONFIG, model)
    assert sorted(p.name for p in dst.rglob("*")) == before
    ckpt.save_model(dst, CONFIG, model, overwrite=True)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    (tmp_path / "file.bin").write_bytes(b"keep")
    for target in (other, tmp_path / "file.bin"):
        with pytest.raises(ValueError, match="is not a kdsa model folder .* even with "
                                             "--overwrite"):
            ckpt.save_model(target, CONFIG, model, overwrite=True)
    assert (other / "todo.txt").read_text() == "keep me"
    assert (tmp_path / "file.bin").read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.bin", "model", "notes"]


def test_foreign_and_damaged_directories(saved, tmp_path):
    from orbax.checkpoint.experimental import v1 as ocp

    with pytest.raises(ckpt.CheckpointError, match="no such checkpoint directory"):
        ckpt.load_model(tmp_path / "nothing")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "README").write_text("hi")
    with pytest.raises(ckpt.CheckpointError, match="not an Orbax checkpoint"):
        ckpt.load_model(tmp_path / "plain")
    ocp.save(tmp_path / "foreign", {"w": np.ones(3, np.float32)})
    with pytest.raises(ckpt.CheckpointError, match="not one written by kdsa"):
        ckpt.load_model(tmp_path / "foreign")
    # damage the array data of a copy of a good checkpoint
    import shutil

    path, _ = saved
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    data = [p for p in broken.rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data
    for p in data:
        p.write_bytes(p.read_bytes()[:16])
    with pytest.raises(ckpt.CheckpointError, match="broken: the array metadata cannot be read "
                                                   r"\(damaged or truncated checkpoint\?\): "
                                                   "OUT_OF_RANGE"):
        ckpt.load_model(broken)


def test_truncated_array_data_message(saved, tmp_path, capsys):
    """Array data cut in half (metadata intact): one line naming the folder and TensorStore's
    reason, without the ``<bound method ...>`` repr and spec dump Orbax's message embeds, and
    no Orbax log spam on stderr."""
    import shutil

    path, _ = saved
    cut = tmp_path / "cut"
    shutil.copytree(path, cut)
    data = [p for p in cut.rglob("*") if p.is_file() and p.parent.name == "d"
            and p.parent.parent.name.startswith("ocdbt.process")]
    assert data
    for p in data:
        p.write_bytes(p.read_bytes()[:p.stat().st_size // 2])
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_model(cut)
    msg = str(e.value)
    assert msg.startswith(f"{cut}: cannot restore") and "damaged" in msg, msg
    assert "Requested byte range" in msg and "\n" not in msg, msg
    assert "bound method" not in msg and "tensorstore_spec" not in msg, msg
    assert "Traceback" not in capsys.readouterr().err
