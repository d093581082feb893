"""Checkpoint checksums (``train/checkpointing.py : checksums``): exact whatever the sharding, so
a run saved on one mesh resumes on another (a float32 sum's last bits depend on the reduction
order, and an exact float check set such a checkpoint aside as corrupt); they catch a changed
bit and a moved element; steps saved before them still check by their float32 sums. And the
RL job's KL reference (``train/rl/reference.py``), a checkpoint of its own."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from kdsa.train.checkpointing import Checkpointer, checksums

SHAPE = (64, 1024)


def _values() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)


def _on(x, ways: int, dim: int | None = 0):
    """``x`` split ``ways`` ways along ``dim`` over the first devices (None: replicated)."""
    mesh = jax.make_mesh((ways,), ("x",), devices=jax.devices()[:ways])
    spec = P() if dim is None else P(*((None,) * dim + ("x",)))
    return jax.device_put(x, NamedSharding(mesh, spec))


def _float_sum(x) -> float:
    return float(jax.jit(lambda v: jnp.sum(v))(x))


def test_checksums_do_not_depend_on_the_sharding_and_catch_changes():
    x = _values()
    layouts = [_on(x, w, d) for w in (1, 2, 4, 8) for d in (0, 1)]
    sums = {checksums({"x": a})["x"] for a in layouts}
    print(f"float32 sums over the layouts: {sorted({_float_sum(a) for a in layouts})}")
    assert len(sums) == 1
    base = sums.pop()
    flipped = x.copy()
    flipped.view(np.uint32)[3, 5] ^= 1  # the last mantissa bit of one element
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert checksums({"x": flipped})["x"] != base
    assert checksums({"x": swapped})["x"] != base
    for dtype in (jnp.bfloat16, jnp.int32, jnp.uint8, jnp.bool_):  # every state dtype
        y = jnp.asarray(x > 0.5 if dtype == jnp.bool_ else x * 8).astype(dtype)
        assert checksums({"y": y})["y"] == checksums({"y": _on(y, 8)})["y"]
    with jax.enable_x64(True):  # 8-byte words (JAX_ENABLE_X64)
        y = jnp.asarray(x, jnp.float64)
        flipped64 = np.asarray(x, np.float64)
        flipped64.view(np.uint64)[0, 0] ^= 1 << 40
        assert checksums({"y": y})["y"] == checksums({"y": _on(y, 8)})["y"] != checksums(
            {"y": jnp.asarray(flipped64)})["y"]


def test_a_step_saved_on_one_mesh_restores_on_another(tmp_path):
    state = {"w": _on(_values(), 8), "b": {"v": _on(np.arange(256, dtype=np.float32), 8)}}
    ck = Checkpointer(tmp_path, every=1, keep=2, async_save=False)
    assert ck.save(1, state, {"data_index": 1})
    ck.close()
    target = {"w": _on(_values(), 2, dim=1),  # another mesh: 2 devices, split on dim 1
              "b": {"v": _on(np.zeros(256, np.float32), 2, dim=None)}}  # replicated
    template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=a.sharding), target)
    messages = []
    ck = Checkpointer(tmp_path, every=1, keep=2)
    got = ck.restore_latest(template, log=messages.append)
    ck.close()
    assert got is not None and got[0] == 1 and not messages, messages
    np.testing.assert_array_equal(np.asarray(got[1]["w"]), _values())
    assert got[1]["w"].sharding == template["w"].sharding


def test_a_step_with_the_old_float_fingerprint_still_checks(tmp_path):
    """Steps written before the checksums hold ``fingerprint``: per-array float32 sums."""
    state = {"w": _on(_values(), 8)}
    ck = Checkpointer(tmp_path, every=1, keep=3, async_save=False)
    for step, scale in ((1, 1.0), (2, 2.0)):
        assert ck.save(step, {"w": state["w"] * scale}, {"data_index": step})
    ck.close()
    for step, scale in ((1, 1.0), (2, 2.0)):
        meta_file = tmp_path / str(step) / "meta" / "data.json"
        meta = json.loads(meta_file.read_text())
        del meta["checksums"]
        meta["fingerprint"] = {"w": _float_sum(state["w"] * scale)}
        if step == 2:  # a corrupted step 2: its recorded sum no longer matches
            meta["fingerprint"]["w"] += 1.0
        meta_file.write_text(json.dumps(meta))
    template = {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32,
                                          sharding=_on(_values(), 4).sharding)}
    messages = []
    ck = Checkpointer(tmp_path, every=1, keep=3)
    got = ck.restore_latest(template, log=messages.append)
    ck.close()
    assert got is not None and got[0] == 1 and ck.skipped == [2], messages
    assert any("step 2" in m and "checksum" in m for m in messages), messages


@pytest.mark.parametrize("fails,why", [(1, "could not read its meta item"),
                                       (2, "could not read it")], ids=["meta", "state"])
def test_a_step_another_process_cannot_read_is_skipped_by_all(tmp_path, monkeypatch, fails,
                                                               why):
    """In a job of several processes each reads its own shards; a step one of them cannot read
    is skipped by every process (else the others would go on into the next collective while it
    falls back). The votes are ``every_process``, faked here: the other process fails step
    2's meta item (the first vote) or its state (the second)."""
    from kdsa.train import checkpointing

    state = {"w": _on(_values(), 8)}
    ck = Checkpointer(tmp_path, every=1, keep=3, async_save=False)
    for step in (1, 2):
        assert ck.save(step, state, {"data_index": step})
    ck.close()
    votes = []

    def vote(ok: bool) -> bool:
        votes.append(ok)
        return ok and len(votes) != fails

    monkeypatch.setattr(checkpointing, "every_process", vote)
    template = {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=state["w"].sharding)}
    messages = []
    ck = Checkpointer(tmp_path, every=1, keep=3)
    got = ck.restore_latest(template, log=messages.append)
    ck.close()
    # step 2: its meta vote (and its state vote unless that failed); step 1: both
    assert got is not None and got[0] == 1 and ck.skipped == [2]
    assert votes == [True] * (fails + 2), votes
    assert any("step 2" in m and "another process" in m and why in m for m in messages), messages


def test_the_kl_reference_belongs_to_the_run_beside_it(tmp_path):
    """``train/rl/reference.py``: a fresh run sets an earlier run's reference aside (renamed,
    not deleted) and saves its own; a resumed run reads its own back; a resumed run past its SFT
    steps without one is refused."""
    from kdsa.train.rl.reference import open_reference

    params = {"w": jax.numpy.arange(8.0)}
    template = jax.eval_shape(lambda: params)
    ck, got = open_reference(tmp_path, template, resumed=False, past_sft=False, log=print)
    assert got is None and ck.save(3, params, {"step": 3}, force=True)
    ck.close()
    messages = []
    ck, got = open_reference(tmp_path, template, resumed=True, past_sft=True,
                             log=messages.append)
    ck.close()
    np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(8.0))
    ck, got = open_reference(tmp_path, template, resumed=False, past_sft=False,
                             log=messages.append)  # a new run into the same folder
    ck.close()
    assert got is None and (tmp_path / "reference.stale" / "3").is_dir()
    assert any("moved to reference.stale" in m for m in messages), messages
    with pytest.raises(ValueError, match="needs the reference policy"):
        open_reference(tmp_path, template, resumed=True, past_sft=True, log=print)
    assert open_reference(tmp_path, template, resumed=True, past_sft=False, log=print)[1] is None
