"""``kdsa generate`` without ``--checkpoint`` on a mesh: the random weights are built in the
``generate`` layout (``rules.build_sharded``), never whole on the host, and generate the greedy
tokens of the host-built model with the same seed.

Three in-process runs of the CLI (2-layer tiny model, ``--seed 3``): on the host (no mesh), on a
1-device mesh (``--mesh data=1``) and on ``data=2,tensor=2`` taken from the ``--config`` file's
``mesh`` section (``fit_layout`` is given the first 1 or 4 of the 8 test devices).
``build_engine`` is wrapped to record the shardings of the weights it receives (before the
runner sees them) and ``rules.shard_model`` (the runner's placement of host-built weights) to
record any call.
"""

import functools
import json

import jax
from flax import nnx
from jax.sharding import NamedSharding

from kdsa.model.overrides import apply_overrides
from kdsa.cli.main import main
from kdsa.infer import generate as gen
from kdsa.model.config import get_preset
from kdsa.sharding import mesh as mesh_lib
from kdsa.sharding import rules

OVERRIDES = ["num_hidden_layers=2", "first_k_dense_replace=1", "attn_res_block_size=1",
             "linear_attn_config.kda_layers=[1]", "linear_attn_config.full_attn_layers=[2]"]


def test_random_weights_are_built_in_the_layout_and_match_the_host_build(tmp_path,
                                                                         monkeypatch):
    config = apply_overrides(get_preset("tiny"), OVERRIDES)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Hello there"}) + "\n"
                       + json.dumps({"id": "b", "prompt_ids": [5, 17, 200, 3, 99]}) + "\n")
    received, placed = [], []

    def record_engine(model, **kw):
        leaves = jax.tree.leaves(nnx.state(model))
        received.append((kw.get("mesh"), [getattr(x, "sharding", None) for x in leaves]))
        return build_engine(model, **kw)

    def record_place(model, mesh, layout):
        placed.append(layout)
        return shard_model(model, mesh, layout)

    build_engine, shard_model = gen.build_engine, rules.shard_model
    monkeypatch.setattr(gen, "build_engine", record_engine)
    monkeypatch.setattr(rules, "shard_model", record_place)

    def tokens(*args):
        out = tmp_path / "out.jsonl"
        assert main(["generate", *args, "--prompts", str(prompts), "--out", str(out),
                     "--seed", "3", "--temperature", "0", "--max-tokens", "5", "--slots", "2",
                     "--max-len", "32", "--prefill-chunk", "16", "--no-progress", "--overwrite"]) == 0
        return [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]

    host = tokens("--preset", "tiny", *(a for o in OVERRIDES for a in ("--set", o)))
    [(mesh, _)] = received
    assert mesh is None and placed == []  # one device, no mesh: the host build
    assert all(len(t) == 5 for t in host)

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config.to_hf_config() | {"mesh": {"generate": "data=2,tensor=2"}}))
    for args, n, axes in [(["--mesh", "data=1"], 1, {}), ([], 4, {"data": 2, "tensor": 2})]:
        received.clear()
        with monkeypatch.context() as m:  # the mesh over the first n of the 8 devices
            m.setattr(mesh_lib, "fit_layout",
                      functools.partial(mesh_lib.fit_layout, devices=jax.devices()[:n]))
            got = tokens("--config", str(cfg), *args)
        [(mesh, shardings)] = received
        assert {a: n for a, n in mesh.shape.items() if n > 1} == axes
        # every weight already on the mesh, in the layout, before the runner saw it
        assert all(isinstance(s, NamedSharding) and s.mesh == mesh for s in shardings)
        if axes:
            assert any(not s.is_fully_replicated for s in shardings)
        assert placed == []  # the runner did not place host-built weights
        assert got == host, (axes, got, host)
