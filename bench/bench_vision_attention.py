"""Memory of the vision tower's attention at ``k3-2.8t``'s widths, compiled only (no run).

One packed row of ``P`` patches, 12 heads of 128 (K3's tower), bfloat16 inputs: XLA's
``memory_analysis()`` of the compiled forward and of the gradient of ``sum(out)`` with respect
to q, k and v, for the tiled path (``model/vision/attention.py : vision_attention_blocked``,
512-patch tiles) and, where it is below ``--dense-max``, the dense reference
(``vision_attention_dense``: ``[B, H, P, P]`` float32 scores). A 4096 x 4096 image is 66,564
patches, padded to 131,072 by the runner. Writes bench/results/vision_attention.json.

    .venv/bin/python bench/bench_vision_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kdsa.model.config import get_preset  # noqa: E402
from kdsa.model.vision.attention import (vision_attention_blocked,  # noqa: E402
                                         vision_attention_dense)


def compiled_bytes(fn, p: int, heads: int, dim: int) -> dict:
    sd = jax.ShapeDtypeStruct
    args = [sd((1, p, heads, dim), jnp.bfloat16)] * 3 + [sd((1, p), jnp.int32)]
    out = {}
    for name, f in (("forward", fn), ("gradient", jax.grad(
            lambda q, k, v, s: fn(q, k, v, s).astype(jnp.float32).sum(), argnums=(0, 1, 2)))):
        t0 = time.perf_counter()
        m = jax.jit(f).lower(*args).compile().memory_analysis()
        out[name] = {"temp_gb": m.temp_size_in_bytes / 1e9,
                     "compile_s": time.perf_counter() - t0}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4K and 16K patches only")
    ap.add_argument("--dense-max", type=int, default=16384,
                    help="largest P for which the dense reference is compiled too")
    a = ap.parse_args()
    vc = get_preset("k3-2.8t").vision_config
    sizes = (4096, 16384) if a.quick else (4096, 16384, 131072)
    rows = []
    for p in sizes:
        row = {"patches": p, "blocked": compiled_bytes(vision_attention_blocked, p,
                                                       vc.num_attention_heads, vc.head_dim)}
        if p <= a.dense_max:
            row["dense"] = compiled_bytes(vision_attention_dense, p, vc.num_attention_heads,
                                          vc.head_dim)
        rows.append(row)
        print(json.dumps(row))
    out = Path(__file__).parent / "results" / "vision_attention.json"
    out.write_text(json.dumps({"heads": vc.num_attention_heads, "head_dim": vc.head_dim,
                               "backend": jax.default_backend(), "rows": rows}, indent=1) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
