"""MXFP4 weight-only matmul at decode shapes: correctness everywhere, speed on an accelerator.

Runs the Pallas kernels (dense, and grouped over a few experts) at M <= 16 rows with
K = N = 7168 (``--quick``: 1024) and checks them against the XLA reference. Prints, measured side
by side in this run:

* the size of MXFP4 expert tensors over bf16, from the real arrays (expected 4.25/16 = 0.266);
* on GPU/TPU: time of a bf16 ``x @ W`` over time of the MXFP4 kernel (target >= 3x at decode,
  where the matmul is weight-bandwidth bound), plus the XLA dequantise-then-dot reference;
* on CPU (not the target; the kernel runs in interpret mode there and is not timed for speed):
  the XLA reference against dense bf16 and f32 matmuls.

Writes bench/results/mxfp4.json.

    .venv/bin/python bench/bench_mxfp4.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kdsa.kernels_pallas import common  # noqa: E402
from kdsa.kernels_pallas.mxfp4_matmul import (mxfp4_grouped_matmul_prepared,  # noqa: E402
                                              mxfp4_grouped_matmul_ref, mxfp4_matmul_prepared,
                                              mxfp4_matmul_ref, prepare_mxfp4_weights)
from kdsa.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402
from timing import seconds, write_results  # noqa: E402  (bench/timing.py)




def rel_error(y, y_ref, x, w_abs_t) -> float:
    """max |y - y_ref| / (|x| @ |W|^T): summation-order error, ~1e-7 in float32."""
    bound = np.abs(np.asarray(x, np.float32)) @ w_abs_t
    return float(np.max(np.abs(np.asarray(y) - np.asarray(y_ref)) / (bound + 1e-30)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="K = N = 1024 instead of 7168")
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args()
    size = 1024 if args.quick else 7168
    experts = 4 if args.quick else 8
    iters = args.iters or (5 if common.backend() == "cpu" else 50)
    on_cpu = common.backend() == "cpu"
    rng = np.random.default_rng(0)
    print(f"device {jax.devices()[0].device_kind} ({common.backend()}), K = N = {size}, "
          f"{experts} experts for the grouped case", flush=True)

    w = jnp.asarray(rng.standard_normal((experts, size, size)) * 0.02, jnp.bfloat16)  # [E, N, K]
    blocks, scales = jax.jit(quantize_mxfp4)(w)
    size_ratio = (blocks.nbytes + scales.nbytes) / w.nbytes
    print(f"MXFP4 / bf16 expert bytes: {size_ratio:.4f} (4.25/16 = {4.25 / 16:.4f})")
    dense_w = prepare_mxfp4_weights(blocks[0], scales[0])
    grouped_w = prepare_mxfp4_weights(blocks, scales)
    w_kn = jnp.asarray(jnp.swapaxes(w[0], 0, 1))                 # bf16 [K, N] for the baseline
    w_abs_t = np.abs(np.asarray(dequantize_mxfp4(blocks[0], scales[0], jnp.float32))).T  # [K, N]

    kernel = jax.jit(mxfp4_matmul_prepared)
    grouped = jax.jit(mxfp4_grouped_matmul_prepared)
    ref = jax.jit(mxfp4_matmul_ref)
    bf16_dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    f32_dot = jax.jit(lambda x, w: jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST))
    w_kn32 = w_kn.astype(jnp.float32)

    rows = {}
    for m in (1, 8, 16):
        x = jnp.asarray(rng.standard_normal((m, size)), jnp.bfloat16)
        y, y_ref = kernel(x, dense_w), ref(x, blocks[0], scales[0])
        row = {"dense_rel_error": rel_error(y, y_ref, x, w_abs_t)}
        sizes = np.bincount(rng.integers(0, experts, m), minlength=experts).astype(np.int32)
        g = jnp.asarray(sizes)
        yg = grouped(x, grouped_w, g)
        yg_ref = jax.jit(mxfp4_grouped_matmul_ref)(x, blocks, scales, g)
        row["grouped_rel_error"] = float(jnp.max(jnp.abs(yg - yg_ref)) / jnp.max(jnp.abs(yg_ref)))
        t_ref = seconds(ref, x, blocks[0], scales[0], reps=iters)
        t_bf16 = seconds(bf16_dot, x, w_kn, reps=iters)
        row.update(ref_s=t_ref, bf16_matmul_s=t_bf16)
        if on_cpu:
            t_f32 = seconds(f32_dot, x.astype(jnp.float32), w_kn32, reps=iters)
            row.update(f32_matmul_s=t_f32, cpu_bf16_over_ref=t_bf16 / t_ref,
                       cpu_f32_over_ref=t_f32 / t_ref)
            print(f"M={m:>2}  dense rel err {row['dense_rel_error']:.1e}  grouped err/max|y| "
                  f"{row['grouped_rel_error']:.1e}  |  CPU (not the target): XLA reference "
                  f"{t_ref * 1e3:7.2f} ms, bf16 matmul {t_bf16 * 1e3:7.2f} ms, f32 matmul "
                  f"{t_f32 * 1e3:7.2f} ms -> bf16/ref {row['cpu_bf16_over_ref']:.2f}x, "
                  f"f32/ref {row['cpu_f32_over_ref']:.2f}x", flush=True)
        else:
            t_k = seconds(kernel, x, dense_w, reps=iters)
            t_g = seconds(grouped, x, grouped_w, g, reps=iters)
            row.update(kernel_s=t_k, grouped_kernel_s=t_g, speedup_vs_bf16=t_bf16 / t_k,
                       ref_over_kernel=t_ref / t_k)
            print(f"M={m:>2}  dense rel err {row['dense_rel_error']:.1e}  grouped err/max|y| "
                  f"{row['grouped_rel_error']:.1e}  |  MXFP4 kernel {t_k * 1e6:8.1f} us, "
                  f"bf16 matmul {t_bf16 * 1e6:8.1f} us -> speedup {row['speedup_vs_bf16']:.2f}x "
                  f"(target >= 3x); XLA dequant+dot {t_ref * 1e6:8.1f} us; grouped kernel "
                  f"({experts} experts) {t_g * 1e6:8.1f} us", flush=True)
        rows[f"M{m}"] = row

    result = {"device": jax.devices()[0].device_kind, "backend": common.backend(),
              "interpret_mode": common.use_interpret(), "K": size, "N": size,
              "experts": experts, "size_ratio_mxfp4_over_bf16": size_ratio, "rows": rows,
              "note": ("CPU: kernels run in interpret mode, only errors are meaningful; times "
                       "compare the XLA reference with dense matmuls, not the target")
              if on_cpu else "speedup_vs_bf16 = bf16 matmul time / MXFP4 kernel time"}
    out = Path(__file__).parent / "results" / "mxfp4.json"
    write_results(out, result)


if __name__ == "__main__":
    main()
