"""The engine's generate steps on one TPU device without a mesh, compiled for XLA:TPU (libtpu;
no TPU needed): the cache left to the default placement (what the runner did before
2026-12-06) against the runner's placement (``infer/cache_layout.py``: the Gated DSA buffers
row-major ``Format``s, dense-slot stacks marked ``rows_major``), side by side in one run.

Per step (prefill chunk, decode; dense slots and paged; XLA attention and the Pallas kernels)
it counts the whole-stack or whole-pool copies and the single layer's slices outside fusions
(the step's in-place writes not counted), and XLA's temporaries and argument bytes. The model
is a 2-layer ``tiny`` with both Gated DSA layers in one scan, bfloat16 (docs/sharding.md,
section 9).

    python bench/bench_tpu_cache_layout.py        # 8 slots x 8K -> results/tpu_cache_layout.json
    python bench/bench_tpu_cache_layout.py --slots 4 --max-len 256
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from timing import write_results  # noqa: E402

from kdsa.infer.cache_layout import TPU_LANES, cache_shardings, row_major  # noqa: E402
from kdsa.infer.runner_steps import decode_step, prefill_step  # noqa: E402
from kdsa.kernels_pallas.common import compile_target  # noqa: E402
from kdsa.model.config import get_preset  # noqa: E402
from kdsa.model.overrides import apply_overrides  # noqa: E402
from kdsa.model.paged_cache import SCRATCH_ROWS, pages_for  # noqa: E402
from kdsa.model.transformer import abstract_model  # noqa: E402
from kdsa.sharding.aot import topology_devices, unfused_instructions  # noqa: E402

CHUNK = 64


def measure(impl: str, paged: bool, placed: bool, slots: int, max_len: int, device) -> dict:
    cfg = apply_overrides(get_preset("tiny"), [
        "num_hidden_layers=2", "linear_attn_config.kda_layers=[]",
        "linear_attn_config.full_attn_layers=[1, 2]", "first_k_dense_replace=0",
        "compute_dtype=bfloat16", "param_dtype=bfloat16", f"attention_impl={impl}"])
    sh = jax.sharding.make_single_device_sharding(device)
    model = abstract_model(cfg)
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), state)
    pages = pages_for(max_len)
    cache = jax.eval_shape(lambda: model.init_paged_cache(
        slots, slots * pages, pages, 1, TPU_LANES).layers if paged
        else model.init_cache(slots, max_len, TPU_LANES))
    if placed:  # the runner's: row-major DSA buffers, stacks marked so
        cache = row_major(cache)
        out_cache = cache_shardings(cache, None, "generate", device)
    else:       # the default placement: no formats, the steps return default layouts
        out_cache = jax.tree.map(lambda _: sh, cache)
    cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         cache, out_cache)
    arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)  # noqa: E731
    i32 = jnp.int32
    tables = ((None, None, arg((pages,), i32)), (arg((slots, pages), i32),)) if paged else ((), ())
    steps = {
        "prefill": (prefill_step, (arg((), i32), arg((1, CHUNK), i32), arg((), i32),
                                   arg((), i32), arg((), jnp.bool_)) + tables[0]),
        "decode": (decode_step, (arg((slots,), i32), arg((slots,), i32),
                                 arg((slots,), jnp.bool_)) + tables[1])}
    rows = rf"{slots * pages * 64 + SCRATCH_ROWS}" if paged else rf"{slots},{max_len}"
    out = {}
    for name, (fn, args) in steps.items():
        with compile_target("tpu"):
            compiled = jax.jit(functools.partial(fn, graphdef), donate_argnums=(1,),
                               out_shardings=(sh, out_cache)).lower(state, cache, *args).compile()
        text, mem = compiled.as_text(), compiled.memory_analysis()
        copies = [ln for ln in text.splitlines()
                  if re.search(rf"= \w+\[2,{rows},\d+\]\S* copy(-start)?\(", ln)]
        sliced = [ln for ln in unfused_instructions(text) if re.search(
            rf"= \w+\[(1,)?{rows},\d+\]\S* (copy|fusion|dynamic-slice)\(", ln)]
        out[name] = {"stack_copies": len(copies), "layer_slices": len(sliced),
                     "temp_mib": round(mem.temp_size_in_bytes / 2**20, 3),
                     "argument_mib": round(mem.argument_size_in_bytes / 2**20, 2)}
        print(f"{impl:6s} {'paged' if paged else 'dense':5s} {name:7s} "
              f"{'runner' if placed else 'default':7s} {out[name]}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="v5e:1x1")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                        "tpu_cache_layout.json"))
    args = p.parse_args()
    device = topology_devices(args.topology)[0]
    result = {"args": vars(args), "steps": {}}
    for impl in ("xla", "pallas"):
        for paged in (False, True):
            for placed in (False, True):
                key = f"{impl}/{'paged' if paged else 'dense'}/{'runner' if placed else 'default'}"
                result["steps"][key] = measure(impl, paged, placed, args.slots, args.max_len,
                                               device)
    write_results(args.out, result)


if __name__ == "__main__":
    main()
