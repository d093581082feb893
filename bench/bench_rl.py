"""One RL step split into rollout, weight-sync and update seconds, on one device and on an
FSDP x EP x TP train layout, with the two ratios issue #17 sets targets for.

For each layout (``one device`` and ``--mesh``, default ``fsdp=2,expert=2,tensor=2`` over 8
host devices) the RL job (``train/rl/loop.py``, tiny preset with 2 layers, a trivially
learnable environment) runs ``--steps`` steps; each step's ``rollout_s``, ``sync_seconds``
and ``update_s`` come from its metrics line, and the first step (compiles) is left out
(best of the rest). Side by side in the same run:

* **update tokens/s / train tokens/s** (target >= 0.8): the RL update's rows x tokens per
  second against the ``kdsa train`` step (``train/step.py``, same layout, same rows and
  sequence length, median of ``--reps`` timed calls after a warm-up);
* **sync seconds / device_put seconds** (target <= 1.5): ``Sampler.sync`` (train layout ->
  the sampler's generate layout, array by array, ``sharding/reshard.py``) against one plain
  ``jax.device_put`` of the same tree to the same shardings (median of ``--reps``).

    python bench/bench_rl.py [--quick] [--mesh fsdp=2,expert=2,tensor=2]

Writes bench/results/rl.json. CPU devices are threads sharing the host's cores: the absolute
numbers are noisy on a shared machine, the ratios less so; the load average is recorded.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test env

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from timing import seconds, write_results  # noqa: E402


def rl_job(config, tc, rc, mesh, sampler, run_dir):
    from kdsa.train.rl.loop import run_rl

    return run_rl(config, tc, rc, run_dir, mesh=mesh, sampler=sampler, progress=False,
                  evaluate_heldout=False)


def train_tokens_per_s(config, tc, rows: int, seq: int, mesh, reps: int) -> float:
    """The ``kdsa train`` step on ``rows x seq`` tokens, on one device or ``mesh``."""
    from kdsa.sharding.constrain import use_sharding
    from kdsa.sharding.train_state import init_sharded, place_batch, train_state_shardings
    from kdsa.train.step import train_step
    from kdsa.train.trainer import prepare

    tc = tc.replace(batch_size=rows, seq_len=seq)
    abstract, graphdef, tx, build = prepare(config, tc)
    toks = np.random.default_rng(0).integers(0, config.vocab_size, (rows, seq + 1))
    batch = {"inputs": toks[:, :-1].astype(np.int32), "targets": toks[:, 1:].astype(np.int32),
             "loss_mask": np.ones((rows, seq), np.float32)}
    if mesh is None:
        state = jax.device_put(build(), jax.local_devices()[0])
        ctx = None
    else:
        template = jax.eval_shape(build)
        shardings = train_state_shardings(graphdef, template, mesh, "train")
        state = init_sharded(build, shardings)
        batch = place_batch(batch, mesh, "train")
        ctx = use_sharding(mesh, "train")
    kw = dict(tc=tc, tx=tx, layout=abstract.segment_layout)

    def step():
        return train_step(graphdef, state, batch, **kw)[1]["loss"]

    if ctx is None:
        return rows * seq / seconds(step, reps=reps)
    with ctx:
        return rows * seq / seconds(step, reps=reps)


def sync_vs_device_put(sampler, graphdef, state, reps: int) -> tuple[float, float]:
    """``(median Sampler.sync seconds, median device_put seconds)`` of the same tree."""
    from kdsa.sharding.rules import state_shardings

    model_state = nnx.state(nnx.merge(graphdef, state.params, state.rest))
    values = jax.tree.map(lambda v: v[...], model_state,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    targets = jax.tree.map(lambda s: s, state_shardings(model_state, sampler.mesh, "generate"),
                           is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    sync = [sampler.sync(graphdef, state) for _ in range(reps + 1)][1:]
    put = seconds(lambda: jax.device_put(values, targets), reps=reps)
    return float(np.median(sync)), put


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="fsdp=2,expert=2,tensor=2")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="3 steps, 3 reps")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "rl.json"))
    args = p.parse_args()
    if args.quick:
        args.steps, args.reps = 3, 3
    import rl_entry  # noqa: F401  registers test_first_letter
    from kdsa.model.overrides import apply_overrides
    from kdsa.model.config import get_preset
    from kdsa.sharding.mesh import make_mesh, parse_mesh_spec
    from kdsa.train.config import TrainConfig
    from kdsa.train.rl.config import RLConfig

    config = apply_overrides(get_preset("tiny"), ["num_hidden_layers=2",
                                                  "linear_attn_config.kda_layers=[1]",
                                                  "linear_attn_config.full_attn_layers=[2]"])
    zero = {"low": 0, "high": 0, "max": 0}
    rc = RLConfig(envs=("test_first_letter",), steps=args.steps, prompts_per_step=4,
                  group_size=8, seq_len=64, num_slots=32, reasoning_caps=zero,
                  token_budgets={"low": 2, "high": 2, "max": 2}, truncation_penalty=0.0,
                  max_sampling_rounds=1, dynamic_sampling=False)
    tc = TrainConfig(steps=args.steps, learning_rate=1e-3, schedule="constant",
                     warmup_steps=0, checkpoint_every=1000, seed=0)
    rows, seq = rc.rollouts_per_step, rc.seq_len
    load0 = os.getloadavg()
    layouts, sampler = {}, None
    for name, mesh in (("one device", None),
                       (args.mesh, make_mesh(parse_mesh_spec(args.mesh)))):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            out = rl_job(config, tc, rc, mesh, sampler, Path(d) / "run")
            wall = time.perf_counter() - t0
        sampler = out.sampler  # compiled once, shared (its weights come from each sync)
        lines = [out.metrics[s] for s in sorted(out.metrics)][1:]  # the first step compiles
        best = {k: min(m[k] for m in lines) for k in ("rollout_s", "sync_seconds", "update_s")}
        update_tps = rows * seq / best["update_s"]
        train_tps = train_tokens_per_s(config, tc, rows, seq, mesh, args.reps)
        sync_s, put_s = sync_vs_device_put(sampler, out.graphdef, out.state, args.reps)
        layouts[name] = {
            "devices": 1 if mesh is None else mesh.size, "job_wall_s": wall,
            **{f"best_{k}": v for k, v in best.items()},
            "update_tokens_per_s": update_tps, "train_tokens_per_s": train_tps,
            "update_over_train": update_tps / train_tps,
            "sync_s": sync_s, "device_put_s": put_s, "sync_over_device_put": sync_s / put_s,
        }
        r = layouts[name]
        print(f"{name:>24}: rollout {best['rollout_s']:.3f}s  sync {best['sync_seconds']:.4f}s  "
              f"update {best['update_s']:.3f}s | update/train tokens/s "
              f"{r['update_over_train']:.2f} (target >= 0.8) | sync/device_put "
              f"{r['sync_over_device_put']:.2f} (target <= 1.5)", flush=True)
    write_results(args.out, {"preset": "tiny (2 layers)", "rows": rows, "seq_len": seq,
                             "steps": args.steps, "reps": args.reps, "layouts": layouts,
                             "load_before": load0, "load_after": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
