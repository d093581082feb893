"""Compile time of the train step's optimizer update against the whole step (CPU).

    python bench/bench_optimizer_compile.py [--preset tiny]

Compiles, each once and ahead of time at the tests' XLA:CPU settings (optimisation level 0):
the whole train step; our optimizer update alone (global-norm clipping, AdamW with the decay
mask, over every parameter array); a plain ``optax.adamw`` over the same arrays; and that AdamW
on one concatenated vector (``optax.flatten``), the fused update a single device could use.
Seconds and fusion counts go to ``bench/results/optimizer_compile.json``. One process, one
measurement each: compile times here vary by about 10% from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                                   "--xla_cpu_copy_insertion_use_region_analysis=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from kdsa.model.config import get_preset  # noqa: E402
from kdsa.train.config import TrainConfig  # noqa: E402
from kdsa.train.step import train_step  # noqa: E402
from kdsa.train.trainer import prepare  # noqa: E402
from timing import write_results  # noqa: E402  (bench/timing.py; the script's folder)


def _compile(fn, *args) -> dict:
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return {"compile_s": round(time.perf_counter() - t0, 2),
            "fusions": compiled.as_text().count("fusion(")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"
                                         / "optimizer_compile.json"))
    args = ap.parse_args()
    tc = TrainConfig(steps=2, batch_size=2, seq_len=16)
    abstract, graphdef, tx, build = prepare(get_preset(args.preset), tc)
    state = jax.eval_shape(build)
    params = state.params
    batch = {k: jax.ShapeDtypeStruct((2, 16), dt) for k, dt in (
        ("inputs", jnp.int32), ("targets", jnp.int32), ("loss_mask", jnp.float32),
        ("segment_ids", jnp.int32))}

    def ours(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    def with_optimizer(opt):
        def update(p, s, g):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s
        return update, jax.eval_shape(opt.init, params)

    result = {"preset": args.preset, "param_arrays": len(jax.tree.leaves(params))}
    result["train_step"] = _compile(lambda s, b: train_step(
        graphdef, s, b, tc=tc, tx=tx, layout=abstract.segment_layout), state, batch)
    result["optimizer_update"] = _compile(ours, params, state.opt_state, params)
    for name, opt in (("adamw_per_array", optax.adamw(1e-3)),
                      ("adamw_one_vector", optax.flatten(optax.adamw(1e-3)))):
        update, opt_state = with_optimizer(opt)
        result[name] = _compile(update, params, opt_state, params)
    result["command"] = f"python bench/bench_optimizer_compile.py --preset {args.preset}"
    result["load_average"] = os.getloadavg()
    write_results(Path(args.out), result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
