"""``kdsa generate --checkpoint DIR`` with a real checkpoint: a tiny model saved by
``kdsa.model.checkpoint.save_model`` generates, through the CLI's main function (in-process), the
greedy tokens the in-memory model generates.

To compile once, the in-memory model runs through the very engine the CLI built (captured from
``build_engine``), with its weights swapped in: the comparison is between the weights restored
from the checkpoint and the weights in memory, on the same compiled steps. The model is not the
``tiny`` preset's seed-0 model (2 layers, seed 7), so a CLI that ignored ``--checkpoint`` and
built random weights would fail. The model's weights are random values set on the abstract
model (``test_convert.random_params``): eager initialisation costs minutes of op-by-op compiles
on a loaded CPU.
"""

import json

import jax
from flax import nnx

from kdsa.model.overrides import apply_overrides
from kdsa.cli.main import main
from kdsa.infer import generate as gen
from kdsa.model.checkpoint import abstract_model, flat_key, save_model
from kdsa.model.config import get_preset

from model_fixtures import random_params

OVERRIDES = ["num_hidden_layers=2", "first_k_dense_replace=1", "attn_res_block_size=1",
             "linear_attn_config.kda_layers=[1]", "linear_attn_config.full_attn_layers=[2]"]


def test_generate_from_a_saved_checkpoint_equals_the_in_memory_model(tmp_path, monkeypatch):
    config = apply_overrides(get_preset("tiny"), OVERRIDES)
    graphdef, state = nnx.split(abstract_model(config))
    values = {k: make() for k, make in random_params(config, 7)}
    model = nnx.merge(graphdef, nnx.from_flat_state(
        [(p, v.replace(values[flat_key(p)])) for p, v in nnx.to_flat_state(state)]))
    save_model(tmp_path / "ckpt", config, model)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Hello there"}) + "\n"
                       + json.dumps({"id": "b", "prompt_ids": [5, 17, 200, 3, 99]}) + "\n")
    built = []

    def capture(*args, **kw):
        built.append(gen_build(*args, **kw))
        return built[-1]

    gen_build = gen.build_engine
    monkeypatch.setattr(gen, "build_engine", capture)
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompts", str(prompts),
                 "--out", str(out), "--temperature", "0", "--max-tokens", "6", "--slots", "2",
                 "--max-len", "64", "--prefill-chunk", "16", "--no-progress"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"]
    assert all(len(r["token_ids"]) == 6 and r["finish_reason"] == "length" for r in rows)

    [(engine, fmt)] = built
    assert engine.runner.config == config          # the checkpoint's config, not a preset's
    # the in-memory weights (committed to the device like restored ones: same compiled steps)
    engine.runner.state = jax.device_put(nnx.split(model)[1],
                                         jax.sharding.make_single_device_sharding(jax.devices()[0]))
    reqs = gen.read_requests(prompts, engine, fmt, effort=None, seed=0,
                             defaults={"max_tokens": 6, "temperature": 0.0, "top_p": 1.0,
                                       "top_k": 0})
    mem = engine.generate(reqs)
    assert [c.token_ids for c in mem] == [r["token_ids"] for r in rows]
    assert [c.text for c in mem] == [r["content"] for r in rows]
