"""Sharded runs equal one-device runs: training on a mesh (8 CPU devices, stopped and resumed
there; and 2 processes x 2 devices through ``kdsa launch-local -- train``), generation on the
``generate`` layout from weights resharded off the ``train`` layout, layout fitting and errors.

References are the same runs on one device; the model is a 2-layer tiny variant (KDA + MoE,
Gated DSA + MoE, Block AttnRes), every step compiled at XLA -O0 (same numerics, half the CPU
compile time).
"""

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from launch_env import launch_env
from kdsa.model.overrides import apply_overrides
from kdsa.infer.engine import Engine, Request
from kdsa.infer.runner import ModelRunner
from kdsa.infer.sampling import SamplingParams
from kdsa.infer.tokenizer import ByteTokenizer
from kdsa.model.config import get_preset
from kdsa.model.transformer import Transformer, abstract_model
from kdsa.sharding.mesh import fit_layout, make_mesh
from kdsa.sharding import train_state
from kdsa.sharding.rules import shard_model
from kdsa.sharding.train_state import init_sharded
from kdsa.train.config import TrainConfig
from kdsa.train.trainer import run_training

# micro-batch 8 rows = data x fsdp x expert; accumulation 2 exercises the micro-batch reshuffle
TC = TrainConfig(steps=3, batch_size=16, seq_len=16, accum_steps=2, warmup_steps=1,
                 learning_rate=1e-2, checkpoint_every=2, keep_checkpoints=3, seed=3)
# two layers (KDA + MoE, Gated DSA + MoE) with Block AttnRes: every sharded path, small compiles
SETS = ["num_hidden_layers=2", "first_k_dense_replace=0", "attn_res_block_size=1",
        "linear_attn_config.kda_layers=[1]", "linear_attn_config.full_attn_layers=[2]"]
LOSS_TOL = 1e-5
FAST = {"xla_backend_optimization_level": 0}


def small_config():
    return apply_overrides(get_preset("tiny"), SETS)


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    run_training(small_config(), TC, run_dir, progress=False, compiler_options=FAST)
    return _metrics(run_dir)


def test_sharded_training_stopped_and_resumed_equals_one_device(single, tmp_path,
                                                               monkeypatch):
    """data=2 x fsdp=2 x expert=2: step-0 state computed sharded (checked below), stop after
    step 2 (sharded checkpoint), resume, step 3."""
    mesh = make_mesh("data=2,fsdp=2,expert=2")
    built = []

    def spy(build, shardings, compiler_options=None):  # the trainer's sharded init
        before = jax.live_arrays()
        state = init_sharded(build, shardings, compiler_options)
        new = [x for x in jax.live_arrays() if not any(x is y for y in before)]
        _check_sharded_init(build, shardings, state, new)  # now: the first step donates it
        built.append(build)
        return state

    monkeypatch.setattr(train_state, "init_sharded", spy)
    first = run_training(small_config(), TC, tmp_path, progress=False, mesh=mesh, stop_at=2,
                         compiler_options=FAST)
    assert len(built) == 1
    assert first.stopped and first.final_step == 2
    rest = run_training(small_config(), TC, tmp_path, progress=False, mesh=mesh, resume=True,
                        compiler_options=FAST)  # restore checks every array's checksum
    assert rest.resumed_from == 2 and rest.final_step == 3
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    errs = [abs(a["loss"] - b["loss"]) for a, b in zip(rows, single)]
    print(f"sharded vs one device, loss errors per step: {errs}")
    assert max(errs) < LOSS_TOL, (rows, single)
    for a, b in zip(rows, single):
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * b["grad_norm"], (a, b)
        assert a["tokens"] == b["tokens"]
        # expert parallel, dropless: every assignment fits (one device: no such metric)
        assert a["moe_dropped"] == 0 and "moe_dropped" not in b
    assert rows[-1]["loss"] != rows[0]["loss"]


def _check_sharded_init(build, shardings, state, new_arrays):
    """The step-0 state computed in its layout equals the host-built one (same seed) and no
    device holds more than its shards: the only arrays the init left alive are the state's own,
    each on its target sharding with per-device buffers of the shard shape."""
    leaves, targets = jax.tree.leaves(state), jax.tree.leaves(shardings)
    assert {id(x) for x in new_arrays} == {id(x) for x in leaves}
    per_device, total = {}, 0
    for x, target in zip(leaves, targets):
        assert x.sharding == target
        for shard in x.addressable_shards:
            assert shard.data.shape == target.shard_shape(x.shape)
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        total += x.nbytes
    print(f"sharded init: {max(per_device.values())} of {total} state bytes on the busiest "
          f"device")
    assert len(per_device) == 8 and max(per_device.values()) < total / 2
    host = build()  # eager, on one device, as the one-device trainer does
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(host)]
    inexact = []
    for path, h, x in zip(paths, jax.tree.leaves(host), leaves):
        h, x = np.asarray(h), np.asarray(x)
        if h.tobytes() != x.tobytes():
            inexact.append(path)  # XLA's fused exp/log may round differently: 1 ulp at most
            np.testing.assert_array_max_ulp(h, x, maxulp=1)
    print(f"sharded init vs host init: {len(leaves) - len(inexact)} of {len(leaves)} arrays "
          f"bit-identical, within 1 ulp: {inexact}")
    assert all("dt_bias" in p for p in inexact)


def test_fit_layout_defaults_and_errors():
    cfg = small_config()
    mesh = fit_layout(cfg, "train", preset="tiny", batch=8, seq=16)
    assert dict(mesh.shape)["fsdp"] == 8
    notes = []
    mesh = fit_layout(cfg, "train", preset="tiny", batch=2, seq=16, log=notes.append)
    assert dict(mesh.shape)["fsdp"] == 2 and mesh.size == 2
    assert "fsdp=2 on 2 of 8 devices" in notes[0]
    # a size whose first weight axis leaves a weight dim whole on every device is passed over
    # for a smaller one (fsdp=8 kept the 12-wide kv_lora weights whole on each device)
    notes = []
    mesh = fit_layout(cfg.replace(kv_lora_rank=12), "train", preset="tiny", batch=8, seq=16,
                      log=notes.append)
    assert dict(mesh.shape)["fsdp"] == 4 and mesh.size == 4, notes
    assert "fsdp=4 on 4 of 8 devices" in notes[0] and "weights" in notes[0]
    mesh = fit_layout(cfg, "generate", preset="tiny", override="data=4,tensor=2", batch=4)
    assert dict(mesh.shape)["tensor"] == 2
    with pytest.raises(ValueError, match=r"the batch size=4 is not divisible by mesh axes "
                                         r"data=2xfsdp=2xexpert=2"):
        fit_layout(cfg, "train", override="data=2,fsdp=2,expert=2", batch=4)
    with pytest.raises(ValueError, match="num_experts=8 is not divisible"):
        fit_layout(cfg, "train", override="expert=-1,tensor=1", devices=jax.devices()[:6])
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by mesh axes "
                                         "tensor=8"):
        run_training(cfg, TC, "/nonexistent-never-written", mesh=make_mesh("tensor=8"))


def test_rl_layouts_leave_each_process_whole_generate_meshes(monkeypatch):
    """Multi-process RL gathers the weights from each process's share of the update's mesh
    onto its first ``rl.generate_devices`` devices. A fitted subset gives every process a
    multiple of them; a mesh that cannot is named before anything compiles (it failed at the
    first weight sync, after the compile)."""
    import types

    from kdsa.sharding import mesh as mesh_mod
    from kdsa.sharding.reshard import local_gather_problem

    devs = [types.SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]  # 2 x 4
    monkeypatch.setattr(mesh_mod, "make_mesh", lambda sizes, devices: (sizes, devices))
    cfg = small_config()
    sizes, use = fit_layout(cfg, "train", preset="tiny", batch=2, seq=16, devices=devs)
    assert sizes["fsdp"] == 2 and [d.id for d in use] == [0, 4]  # 1 device per process
    sizes, use = fit_layout(cfg, "train", preset="tiny", batch=4, seq=16, devices=devs,
                            per_process_multiple=2)
    assert sizes["fsdp"] == 4 and [d.id for d in use] == [0, 1, 4, 5]
    with pytest.raises(ValueError, match="fsdp=2 fits the model and batch but gives each of 2 "
                                         "processes 1 devices, not a multiple of 2"):
        fit_layout(cfg, "train", preset="tiny", batch=2, seq=16, devices=devs,
                   per_process_multiple=2)
    assert local_gather_problem(use, 2, devs) is None
    assert "{0: 1, 1: 1} per process" in local_gather_problem([devs[0], devs[4]], 2, devs)
    three = [types.SimpleNamespace(id=i, process_index=i // 3) for i in range(6)]  # 2 x 3
    assert "a multiple of 2" in local_gather_problem(three, 2, three)
    assert "missing {0: [1]}" in local_gather_problem([devs[0], devs[2], devs[4], devs[5]], 2,
                                                      devs)
    assert local_gather_problem(three, 1, three) is None and \
        local_gather_problem(three, 3, three) is None


# ---------------------------------------------------------------------------------------------
# generation on the generate layout
# ---------------------------------------------------------------------------------------------

SLOTS, MAX_LEN, CHUNK, NEW = 4, 64, 16, 5


def _generate(runner, prompts):
    eng = Engine(runner, ByteTokenizer(runner.vocab_size), max_top_logprobs=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return eng.generate([Request(p, greedy) for p in prompts])


PROMPTS = [[int(t) for t in np.random.default_rng(0).integers(0, 256, n)]
           for n in (5, 16, 11, 3, 9)]


@pytest.fixture(scope="module")
def model0():
    """``(graphdef, state)`` of the model with random weights, seed 0 (built once, eagerly)."""
    return nnx.split(Transformer(small_config(), rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def gen_ref(model0):
    """Greedy completions of ``PROMPTS`` on one device (random weights, seed 0)."""
    return _generate(ModelRunner(nnx.merge(*model0, copy=True), num_slots=SLOTS,
                                 max_len=MAX_LEN, prefill_chunk=CHUNK, min_bucket=CHUNK,
                                 compiler_options=FAST), PROMPTS)


def test_sharded_generation_from_the_train_layout_equals_one_device(gen_ref, model0):
    """Weights on the train layout (fsdp=2 x expert=2 x tensor=2) are resharded to the generate
    layout on another mesh (data=2 x expert=2 x tensor=2: slots over data x expert) and give the
    one-device greedy tokens."""
    cfg, prompts, ref = small_config(), PROMPTS, gen_ref
    model = shard_model(nnx.merge(*model0, copy=True), make_mesh("fsdp=2,expert=2,tensor=2"),
                        "train")  # a copy of the seed-0 model of gen_ref
    gen_mesh = make_mesh("data=2,expert=2,tensor=2")
    with pytest.raises(ValueError, match=r"num_slots=6 must be a multiple of the generate "
                                         r"layout's batch axes data=2xexpert=2 \(product 4\)"):
        ModelRunner(model, num_slots=6, max_len=MAX_LEN, mesh=gen_mesh)
    runner = ModelRunner(model, num_slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                         min_bucket=CHUNK, mesh=gen_mesh, compiler_options=FAST)
    assert runner.reshard_report is not None and runner.reshard_report.arrays > 0
    got = _generate(runner, prompts)  # 5 requests on 4 slots: a slot is reused
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    lp_err = max(abs(a - b) for g, r in zip(got, ref) for a, b in zip(g.logprobs, r.logprobs))
    print(f"sharded generation: log-prob error {lp_err:.2e}")
    assert lp_err < 1e-4
    leaf = jax.tree.leaves(runner.cache)[0]
    assert leaf.sharding.spec[1] == ("data", "expert") and len(leaf.sharding.device_set) == 8


def test_a_prefill_reads_and_writes_its_slot_without_gathering_every_slot():
    """With the slots split over devices, the prefill step's slot read and write equal the
    dynamic slice and update, and compile to one row's all-reduce, not an all-gather of every
    slot (which cost K3's 128K-token prefill step 230 GB per device: docs/sharding.md)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kdsa.infer.runner_steps import put_slot, take_slot
    from kdsa.sharding.constrain import use_sharding

    mesh = make_mesh("data=4,expert=2")
    a = jnp.arange(3 * 8 * 5 * 2, dtype=jnp.float32).reshape(3, 8, 5, 2) - 100.0
    a = jax.device_put(a, NamedSharding(mesh, P(None, ("data", "expert"))))
    row = -jnp.ones((3, 1, 5, 2), jnp.float32)
    with use_sharding(mesh, "generate"):
        take, put = jax.jit(take_slot), jax.jit(put_slot)
        hlo = take.lower(a, 5).compile().as_text() + put.lower(a, row, 5).compile().as_text()
        got_row, got_put = take(a, 5), put(a, row, 5)
    assert "all-gather" not in hlo and "all-reduce" in hlo
    np.testing.assert_array_equal(got_row, a[:, 5:6])
    np.testing.assert_array_equal(got_put, a.at[:, 5:6].set(row))
    np.testing.assert_array_equal(take_slot(a, 2), a[:, 2:3])  # no mesh: the dynamic slice


# ---------------------------------------------------------------------------------------------
# two processes x two devices: one launch of train + reshard round trip + generate
# ---------------------------------------------------------------------------------------------

def test_two_process_job_train_reshard_generate_equals_one_device(single, gen_ref, tmp_path):
    """One ``kdsa launch-local`` job of 2 processes x 2 devices (gloo) runs, in each process
    (``tests/jobcheck.py``):

    1. ``kdsa train --mesh expert=2,sequence=2``: batch rows fed per process, expert-parallel
       MoE and sequence-parallel KDA / DSA across processes, the step-0 state computed sharded,
       checkpoints written by both; the losses equal the one-device run's;
    2. ``reshard-check``: the last checkpoint restored onto the train mesh, moved to the
       generate layout on ``data=2,tensor=2`` over the devices reversed (shards change process)
       and back: bit-exact both ways, the round trip on the original shardings;
    3. ``kdsa generate --mesh data=2,tensor=2 --num-pages``: the paged cache with the prefix
       cache, a partition of the pool per device group (``model/paged_attention.py``), across
       the two processes; process 0 writes the one-device greedy tokens
       (the CLI's chat-format stop ids may end a request early: then its tokens are a prefix
       ending in a stop).

    The two processes share compiled programs: process 0 compiles each multi-process program
    and hands it to process 1 (``KDSA_SHARE_COMPILES``, ``distributed.share_compiles``)."""
    run_dir, check = tmp_path / "run", tmp_path / "reshard.json"
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    model = ["--preset", "tiny", *[a for s in SETS for a in ("--set", s)]]
    train_sets = [a for k, v in dataclasses.asdict(TC).items() if v != getattr(TrainConfig(), k)
                  for a in ("--train-set", f"{k}={json.dumps(v)}")]
    steps = [["train", *model, *train_sets, "--mesh", "expert=2,sequence=2", "--run-dir",
              str(run_dir), "--no-progress"],
             ["reshard-check", *model, *train_sets, "--run-dir", str(run_dir), "--train-mesh",
              "expert=2,sequence=2", "--mesh", "data=2,tensor=2", "--out", str(check)],
             ["generate", *model, "--mesh", "data=2,tensor=2", "--slots", str(SLOTS),
              "--max-len", str(MAX_LEN), "--num-pages", str(SLOTS * -(-MAX_LEN // 64)),
              "--prefill-chunk", str(CHUNK), "--max-tokens",
              str(NEW), "--temperature", "0", "--prompts", str(src), "--out", str(out),
              "--no-progress"]]
    cmd = [sys.executable, "-m", "kdsa.cli.main", "launch-local", "--processes", "2",
           "--devices-per-process", "2", "--timeout", "500", "--module",
           "jobcheck", "--", *[a for s in steps for a in (*s, "+")][:-1]]
    env = launch_env(KDSA_SHARE_COMPILES=str(tmp_path / "jax_cache"))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print("\n".join(x for x in proc.stdout.splitlines() if "jobcheck:" in x))

    assert "mesh expert=2,sequence=2 (2 process(es))" in proc.stdout
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    errs = [abs(a["loss"] - b["loss"]) for a, b in zip(rows, single)]
    print(f"2 processes vs one device, loss errors per step: {errs}")
    assert max(errs) < LOSS_TOL, (rows, single)
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()
                  if p.name.isdigit()) == [2, 3]

    rep = json.loads(check.read_text())
    print(f"reshard: {rep['arrays']} arrays, {rep['cross_process_arrays']} across processes, "
          f"{rep['to_generate']['seconds']:.3f} s + {rep['to_train']['seconds']:.3f} s")
    abstract = nnx.state(abstract_model(small_config()))
    n_vars = len(nnx.to_flat_state(abstract))  # counts and shapes: no eager build needed
    assert rep["checkpoint_step"] == 3 and rep["arrays"] == n_vars
    assert rep["cross_process_arrays"] > rep["arrays"] // 2
    assert rep["elements"] == sum(x.size for x in jax.tree.leaves(abstract))
    assert rep["generate_bits_differing"] == 0 and rep["generate_shardings_by_rules"]
    assert rep["round_trip_bit_exact"] and rep["round_trip_shardings_equal"] and rep["ok"]

    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == len(PROMPTS)
    for row, want in zip(got, gen_ref):
        assert row["token_ids"] == want.token_ids[:len(row["token_ids"])]
        assert len(row["token_ids"]) == NEW or row["finish_reason"] == "stop"
