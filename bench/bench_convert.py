"""Conversion throughput and memory: ``kdsa convert`` next to raw safetensors read / write speed.

Builds a random Kimi-Linear-style checkpoint (bf16; ``--quick`` about 300 MB, default about
3 GB), then measures in fresh child processes (so each peak RSS is its own):

* ``hf_to_orbax``: HF safetensors -> Orbax (bf16 experts), and -> Orbax with ``--experts mxfp4``,
  Orbax write batches of the largest stacked parameter's size (``--batch-size``);
* ``orbax_to_hf``: back to safetensors;
* the limits: reading every tensor of the same safetensors from the memmap, and writing the same
  number of bytes to one file (page cache, no fsync, as the conversion);

and prints MB/s, the ratios conversion / raw, peak RSS above the starting RSS next to the
largest stacked parameter, and the size of the MXFP4 expert tensors over bf16 (0.266 expected).
Writes ``bench/results/convert.json``. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "convert.json"


def bench_config(quick: bool):
    from kdsa.model.config import LinearAttnConfig, ModelConfig

    layers = 4 if quick else 8
    full = tuple(range(4, layers + 1, 4))
    return ModelConfig(
        vocab_size=32768, hidden_size=1024, num_hidden_layers=layers, intermediate_size=4096,
        num_attention_heads=8, q_lora_rank=None, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, mla_use_nope=True,
        linear_attn_config=LinearAttnConfig(
            kda_layers=tuple(i for i in range(1, layers + 1) if i not in full),
            full_attn_layers=full, num_heads=8, head_dim=128),
        num_experts=16 if quick else 96, num_experts_per_token=4, num_shared_experts=1,
        moe_intermediate_size=512, first_k_dense_replace=1, param_dtype="bfloat16",
        compute_dtype="bfloat16")


def make_source(config, root: Path) -> Path:
    """Random parameters -> Orbax -> HF (the HF files are the benchmark's source)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from kdsa.model import checkpoint as ckpt
    from kdsa.train.convert import orbax_to_hf

    rng = np.random.default_rng(0)

    def items():
        for k, v in ckpt.flat_variables(nnx.state(ckpt.abstract_model(config))).items():
            a = rng.standard_normal(v.shape, np.float32) * 0.02
            yield k, (lambda a=a, dt=v.dtype: jnp.asarray(a, dt))

    ckpt.save_params(root / "src_orbax", config, items(), overwrite=True)  # a rerun replaces
    orbax_to_hf(root / "src_orbax", root / "hf", layout="kimi_linear", progress=False,
                overwrite=True)
    shutil.rmtree(root / "src_orbax")
    return root / "hf"


def child(args) -> dict:
    """One measurement in this (fresh) process; prints a JSON line."""
    from kdsa.train.convert import pipeline as convert
    from kdsa.train.convert.safetensors_io import SafetensorsCheckpoint

    rss0 = convert._rss_now()
    t0 = time.perf_counter()
    if args.child == "raw_read":
        src = SafetensorsCheckpoint(args.src)
        total = 0
        for n in src.names():
            a = src.tensor(n)
            total += int(a.view("u1").sum(dtype="u8") >= 0) * a.nbytes  # touch every byte
        out = {"bytes": total}
    elif args.child == "raw_write":
        import numpy as np

        nbytes, block = int(args.nbytes), 64 << 20
        buf = np.random.default_rng(0).integers(0, 255, block, dtype=np.uint8)
        with open(args.dst, "wb") as f:
            left = nbytes
            while left > 0:
                f.write(buf[:min(left, block)].data)
                left -= block
        out = {"bytes": nbytes}
    elif args.child == "hf_to_orbax":
        s = convert.hf_to_orbax(args.src, args.dst, experts=args.experts, progress=False,
                                batch_bytes=int(args.nbytes), overwrite=True)
        out = {"bytes": s.bytes_read, "written": s.bytes_written}
    else:
        s = convert.orbax_to_hf(args.src, args.dst, progress=False, overwrite=True)
        out = {"bytes": s.bytes_written, "read": s.bytes_read}
    out["seconds"] = time.perf_counter() - t0
    out["peak_rss_delta"] = max(convert._peak_rss() - rss0, 0)
    print("RESULT " + json.dumps(out), flush=True)
    return out


def run_child(kind: str, **kw) -> dict:
    cmd = [sys.executable, __file__, "--child", kind]
    for k, v in kw.items():
        if v is not None:
            cmd += [f"--{k}", str(v)]
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise SystemExit(f"{kind} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return json.loads(line[7:])


def expert_bytes(path: Path) -> int:
    from kdsa.train.convert.safetensors_io import SafetensorsCheckpoint

    c = SafetensorsCheckpoint(path)
    return sum(c.info(n).nbytes for n in c.names() if ".experts." in n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="about 300 MB instead of about 3 GB")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse DIR/hf from an earlier run with --dir (same --quick)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    for name in ("src", "dst", "experts", "nbytes"):
        ap.add_argument(f"--{name}", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    import numpy as np
    from flax import nnx

    from kdsa.model import checkpoint as ckpt

    config = bench_config(args.quick)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_convert_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        hf = root / "hf" if args.reuse and (root / "hf").is_dir() else make_source(config, root)
        total = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
        largest = max(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in
                      ckpt.flat_variables(nnx.state(ckpt.abstract_model(config))).values())
        print(f"source: {total / 1e6:.0f} MB of safetensors (made in {time.perf_counter() - t:.0f}"
              f" s); largest stacked parameter {largest / 1e6:.0f} MB")
        r = {"raw_read": run_child("raw_read", src=hf),
             "raw_write": run_child("raw_write", dst=root / "raw.bin", nbytes=total),
             "hf_to_orbax": run_child("hf_to_orbax", src=hf, dst=root / "orbax",
                                      nbytes=largest),
             "hf_to_orbax_mxfp4": run_child("hf_to_orbax", src=hf, dst=root / "orbax_q",
                                            experts="mxfp4", nbytes=largest),
             "orbax_to_hf": run_child("orbax_to_hf", src=root / "orbax", dst=root / "hf2")}
        run_child("orbax_to_hf", src=root / "orbax_q", dst=root / "hf_q")
        mbps = {k: v["bytes"] / 1e6 / v["seconds"] for k, v in r.items()}
        ratio_mxfp4 = expert_bytes(root / "hf_q") / expert_bytes(hf)
        out = {
            "quick": args.quick, "source_bytes": total, "largest_param_bytes": largest,
            "mb_per_s": mbps,
            "ratio_hf_to_orbax_vs_raw_read": mbps["hf_to_orbax"] / mbps["raw_read"],
            "ratio_hf_to_orbax_vs_raw_write": mbps["hf_to_orbax"] / mbps["raw_write"],
            "ratio_orbax_to_hf_vs_raw_write": mbps["orbax_to_hf"] / mbps["raw_write"],
            "peak_rss_delta_bytes": {k: v["peak_rss_delta"] for k, v in r.items()},
            "peak_rss_over_largest_param": {k: v["peak_rss_delta"] / largest
                                            for k, v in r.items()},
            "mxfp4_expert_bytes_over_bf16": ratio_mxfp4,
            "seconds": {k: v["seconds"] for k, v in r.items()},
        }
        for k in r:
            print(f"{k:<18} {mbps[k]:8.1f} MB/s  {r[k]['seconds']:6.2f} s  peak RSS "
                  f"+{r[k]['peak_rss_delta'] / 2**20:.0f} MiB "
                  f"({r[k]['peak_rss_delta'] / largest:.2f}x the largest parameter)")
        print(f"hf->orbax / raw read {out['ratio_hf_to_orbax_vs_raw_read']:.3f}, / raw write "
              f"{out['ratio_hf_to_orbax_vs_raw_write']:.3f}; orbax->hf / raw write "
              f"{out['ratio_orbax_to_hf_vs_raw_write']:.3f}")
        print(f"MXFP4 expert tensors / bf16: {ratio_mxfp4:.4f} (4.25/16 = 0.2656)")
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {RESULTS}")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
