"""Ahead-of-time compiles of the Pallas kernels for TPU chips at K3 shapes, on a CPU-only host.

With ``libtpu`` installed (the test extra), ``jax.experimental.topologies`` gives abstract TPU
devices and ``jax.jit(f).lower(...).compile()`` runs the real XLA:TPU and Mosaic compilers.
For each kernel, chip and shape this records: compiled or not (the compiler's first error line
when not), compile seconds, XLA's per-device memory (arguments, outputs, temporaries, generated
code), the largest scoped VMEM any op of the compiled program uses
(``used_scoped_memory_configs`` in the compiled HLO: the Mosaic kernel or an XLA fusion), the
scoped VMEM of the Pallas kernels themselves (``kernel_vmem_bytes``: their custom calls, largest)
and, for sparse MLA, ``cache_copies``: instructions other than the parameters that produce an
array of a key cache's shape before the kernel (a copy or re-layout of the cache per call; 0
means the kernel reads the caller's cache in place).

Shapes (K3, ``k3-2.8t``):

* MXFP4 dense (decode): M 1 and 16 rows, K = N = 7168;
* MXFP4 grouped (routed experts, 14 experts per device = 896 / 64): gate/up K 3584 -> N 3072,
  down K 3072 -> N 3584, 2048 sorted rows;
* sparse MLA (Mosaic): 64 and 128 heads, Dk 576 = 512 + 64, v_dim 512, top-2048, bf16,
  context 32K and 128K, a prefill chunk of 256 queries and a decode step (1 query), forward
  and backward. The key caches are arguments in row-major layout (``Format(Layout((0, 1, 2)))``,
  as a decode step should keep them: XLA's default layout for a bf16 ``[B, S, 64]`` array is
  S-minor, which the kernel cannot gather from, so XLA would copy the RoPE cache per call;
  docs/kernels.md, "TPU compile").

    python bench/aot.py [--chips v5e,v5p,v6e] [--quick] [--only SUBSTRING] [--out FILE]

``--quick``: one chip, the smaller shapes. ``--only``: the kernels whose name contains it,
merged into an existing ``--out`` file (other rows kept). Writes bench/results/aot.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import write_results  # noqa: E402

TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
BF16, U8, I32 = jnp.bfloat16, jnp.uint8, jnp.int32


def _format(layout, sharding):
    from jax.experimental.layout import Format, Layout

    return sharding if layout is None else Format(Layout(major_to_minor=layout), sharding)


def compile_one(device, fn, shapes) -> dict:
    """``shapes``: ``(shape, dtype)`` or ``(shape, dtype, major_to_minor)`` per argument; the
    arguments with a layout are the key caches (``cache_copies``)."""
    from kdsa.kernels_pallas import common

    sharding = jax.sharding.make_single_device_sharding(device)
    shapes = [tuple(x) + (None,) * (3 - len(x)) for x in shapes]
    args = [jax.ShapeDtypeStruct(s, d, sharding=_format(lay, sharding)) for s, d, lay in shapes]
    t0 = time.perf_counter()
    try:
        with common.compile_target("tpu"):
            compiled = jax.jit(fn).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - the compiler's error is the result
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        reason = next((x for x in lines if "Mosaic" in x or "E2003" in x or "error" in x.lower()),
                      lines[0] if lines else type(e).__name__)
        return {"compiled": False, "seconds": round(time.perf_counter() - t0, 1),
                "error": reason[:400]}
    m = compiled.memory_analysis()
    text = compiled.as_text()
    scoped = r'"used_scoped_memory_configs":\[\{[^]]*?"size":"(\d+)"'
    vmem = [int(x) for x in re.findall(scoped, text)]
    kernel_vmem = [int(x) for line in text.splitlines() if '"tpu_custom_call"' in line
                   for x in re.findall(scoped, line)]
    row = {"compiled": True, "seconds": round(time.perf_counter() - t0, 1),
           "argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
           "temp_bytes": m.temp_size_in_bytes, "code_bytes": m.generated_code_size_in_bytes,
           "scoped_vmem_bytes": max(vmem) if vmem else None,
           "kernel_vmem_bytes": max(kernel_vmem) if kernel_vmem else None}
    caches = [f"{jnp.dtype(d).name.replace('bfloat16', 'bf16')}[{','.join(map(str, s))}]"
              for s, d, lay in shapes if lay is not None]
    if caches:  # readers of a cache parameter other than the kernels (copies, re-layouts)
        lines = [ln.strip() for ln in text.splitlines() if " = " in ln]
        params = [ln.split(" = ")[0] for ln in lines if "parameter(" in ln
                  and any(ln.split(" = ")[1].startswith(c) for c in caches)]
        row["cache_copies"] = sum(
            1 for ln in lines if '"tpu_custom_call"' not in ln and any(
                re.search(re.escape(n) + r"[,)]", ln.split(" = ", 1)[1]) for n in params))
    return row


def cases(quick: bool):
    from kdsa.kernels_pallas.mxfp4_matmul import mxfp4_grouped_matmul, mxfp4_matmul
    from kdsa.kernels_pallas.sparse_mla import sparse_mla_attention

    k = n = 7168
    for m in ((16,) if quick else (1, 16)):
        yield (f"mxfp4 dense M{m} K{k} N{n}", mxfp4_matmul,
               [((m, k), BF16), ((n, k // 32, 16), U8), ((n, k // 32), U8)])
    e, rows = 14, 2048
    for name, kk, nn in (("gate/up", 3584, 3072), ("down", 3072, 3584)):
        yield (f"mxfp4 grouped {name} E{e} M{rows} K{kk} N{nn}", mxfp4_grouped_matmul,
               [((rows, kk), BF16), ((e, nn, kk // 32, 16), U8), ((e, nn, kk // 32), U8),
                ((e,), I32)])
    dc, dr, topk = 512, 64, 2048
    for heads in ((64,) if quick else (64, 128)):
        for ctx in ((32768,) if quick else (32768, 131072)):
            for label, t in (("prefill chunk 256", 256), ("decode", 1)):
                shapes = [((1, t, heads, dc + dr), BF16), ((1, ctx, dc), BF16, (0, 1, 2)),
                          ((1, ctx, dr), BF16, (0, 1, 2)), ((1, t, topk), I32)]

                def fwd(q, a, r, i):
                    return sparse_mla_attention(q, (a, r), i, 0.1, dc)

                def grad(q, a, r, i):
                    return jax.grad(lambda q, a, r: fwd(q, a, r, i)[0].sum(),
                                    argnums=(0, 1, 2))(q, a, r)

                yield f"sparse_mla fwd H{heads} S{ctx} {label}", fwd, shapes
                if t > 1:
                    yield f"sparse_mla bwd H{heads} S{ctx} {label}", grad, shapes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chips", default="v5e,v5p,v6e")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="kernels whose name contains this")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "aot.json"))
    args = ap.parse_args(argv)
    from kdsa.train.aot import topology_devices

    chips = args.chips.split(",")[:1] if args.quick else args.chips.split(",")
    bad = [c for c in chips if c not in TOPOLOGIES]
    if bad:
        raise SystemExit(f"--chips: unknown chip(s) {bad}; choose from {sorted(TOPOLOGIES)}")
    try:  # libtpu is imported here (a clear message without it)
        devices = {chip: topology_devices(TOPOLOGIES[chip])[0] for chip in chips}
    except ValueError as e:
        raise SystemExit(f"bench/aot.py: {e}") from None
    out = {"jax": jax.__version__, "libtpu": getattr(sys.modules["libtpu"], "__version__", "?"),
           "results": []}
    for chip, device in devices.items():
        for name, fn, shapes in cases(args.quick):
            if args.only not in name:
                continue
            r = {"chip": chip, "kernel": name, **compile_one(device, fn, shapes)}
            status = (f"ok {r['seconds']}s, temp {r['temp_bytes'] / 2**20:.1f} MiB, code "
                      f"{r['code_bytes'] / 2**10:.0f} KiB, kernel VMEM "
                      f"{(r['kernel_vmem_bytes'] or 0) / 2**20:.2f} MiB"
                      + (f", cache copies {r['cache_copies']}" if "cache_copies" in r else "")
                      if r["compiled"] else f"FAILED {r['seconds']}s: {r['error'][:160]}")
            print(f"{chip} {name}: {status}", flush=True)
            out["results"].append(r)
    if args.only and Path(args.out).exists():  # merge: keep the rows not re-run
        done = {(r["chip"], r["kernel"]) for r in out["results"]}
        kept = [r for r in json.loads(Path(args.out).read_text())["results"]
                if (r["chip"], r["kernel"]) not in done]
        out["results"] = kept + out["results"]
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
