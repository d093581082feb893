"""MXFP4 experts under expert parallelism, compiled for XLA:TPU (libtpu; no TPU needed): the
engine's generate steps of ``k3-slice`` with MXFP4 experts on ``v5e:2x2`` (``expert=4``), with
``moe_impl=xla`` (each device dequantises its experts into a float copy, the memory every
device held on this path before 2026-12-07) against ``moe_impl=pallas`` (the grouped MXFP4
kernel on each device's own experts' bytes), side by side in one run, through ``kdsa plan
--compile`` (docs/sharding.md section 4). Per step: XLA's temporaries, arguments and peak
bytes per device, and the Pallas kernels in it.

    python bench/bench_mxfp4_expert_parallel.py   # -> results/mxfp4_expert_parallel.json
    python bench/bench_mxfp4_expert_parallel.py --seq 1024 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from timing import write_results  # noqa: E402

from kdsa.cli.main import main as kdsa  # noqa: E402


def plan(impl: str, args) -> dict:
    """``kdsa plan --compile --json`` of the generate steps with ``moe_impl=impl``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = kdsa(["plan", "--preset", args.preset, "--set", "expert_weight_format=mxfp4",
                   "--set", f"moe_impl={impl}", "--layout", "generate", "--mesh", args.mesh,
                   "--batch", str(args.batch), "--seq", str(args.seq), "--prefill-chunk",
                   str(args.prefill_chunk), "--compile", "--topology", args.topology,
                   "--json"])
    if rc:
        raise SystemExit(f"kdsa plan --set moe_impl={impl} failed ({rc})")
    compiled = json.loads(out.getvalue())["compiled"]
    return {step: {k: c[k] for k in ("temporaries", "arguments", "peak", "kernels",
                                     "compile_seconds")} for step, c in compiled.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-slice")
    ap.add_argument("--mesh", default="expert=4")
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                         "mxfp4_expert_parallel.json"))
    args = ap.parse_args()
    steps = {impl: plan(impl, args) for impl in ("xla", "pallas")}
    for step in steps["xla"]:
        x, p = steps["xla"][step], steps["pallas"][step]
        print(f"{step}: temporaries per device {x['temporaries'] / 1e6:.0f} MB (dequantised "
              f"copy) -> {p['temporaries'] / 1e6:.0f} MB (kernel on the bytes), peak "
              f"{x['peak'] / 1e9:.2f} -> {p['peak'] / 1e9:.2f} GB; kernels {p['kernels']}")
    write_results(args.out, {"config": vars(args), "steps": steps})


if __name__ == "__main__":
    main()
