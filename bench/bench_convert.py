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

``safetensors_io`` (key ``safetensors_io`` in the results; ``--io-only`` runs just this part):
our reader (``SafetensorsCheckpoint``: memmap views copied in 32 MB chunks with ``MADV_DONTNEED``
after each, as ``read.host_slice`` does) next to the ``safetensors`` package
(``safe_open(path, framework="numpy", backend=...)``, ``get_slice(name)[:]`` / ``[a:b]``: the
``mmap`` backend with one open per file, or one open per tensor (``_reopen``, which unmaps after
each tensor), and the ``pread`` backend), each in a fresh process on a warm page cache, reading
(a) every tensor whole and (b) every tensor as 8 row slices (what a process of a multi-host
conversion reads); ``ours_keep`` is our reader without the page release. Best of 3 passes (and
the first), peak RSS above the start over the passes. Then our streaming writer
(``write_checkpoint``, one produced tensor at a time) next to ``safetensors.numpy.save_file``
(which takes every tensor of a shard at once) writing the source's tensors into one 5 GB-capped
shard. Writes ``bench/results/convert.json``. Not a test.
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


def _machine() -> dict:
    """``timing.machine()``, imported only here: the raw-read child processes must not pay for
    importing JAX (``timing`` imports it)."""
    from timing import machine  # (bench/timing.py; the script's folder)

    return machine()


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
    if args.child == "io_read":
        out = io_read(args)
    elif args.child == "io_write":
        out = io_write(args)
    elif args.child == "raw_read":
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
    out.setdefault("peak_rss_delta", max(convert._peak_rss() - rss0, 0))  # io_*: own window
    print("RESULT " + json.dumps(out), flush=True)
    return out


IO_READERS = ("ours", "ours_keep", "pkg_mmap", "pkg_mmap_reopen", "pkg_pread")
IO_SLICES = 8          # row slices per tensor in the "rows" mode
IO_PASSES = 3


def _row_slices(shape: tuple[int, ...], whole: bool) -> list[slice]:
    n = shape[0] if shape else 0
    if whole or n < IO_SLICES:
        return [slice(None)]
    return [slice(n * i // IO_SLICES, n * (i + 1) // IO_SLICES) for i in range(IO_SLICES)]


def io_read(args) -> dict:
    """One reader over every tensor of ``args.src``; ``args.experts`` = reader, ``args.dst`` =
    mode (``whole`` / ``rows``). Each piece is materialised in a fresh array and dropped."""
    from kdsa.train.convert import pipeline as convert
    from kdsa.train.convert.read import aligned_empty, copy_chunked
    from kdsa.train.convert.safetensors_io import SafetensorsCheckpoint

    reader, whole = args.experts, args.dst == "whole"
    ckpt = SafetensorsCheckpoint(args.src)          # headers (names, shapes) for both readers
    by_file: dict[str, list[str]] = {}
    for n in ckpt.names():
        by_file.setdefault(ckpt.where[n], []).append(n)
    rss0 = convert._rss_now()
    passes, total = [], 0
    for _ in range(IO_PASSES):
        t0, total = time.perf_counter(), 0
        if reader in ("ours", "ours_keep"):        # ours_keep: no MADV_DONTNEED
            src = SafetensorsCheckpoint(args.src)
            for n in src.names():
                view = src.tensor(n)
                for sl in _row_slices(view.shape, whole):
                    piece = view[sl]
                    out = aligned_empty(piece.shape, piece.dtype)
                    copy_chunked(out, piece, (lambda: None) if reader == "ours_keep"
                                 else lambda n=n: src.release([n]))
                    total += out.nbytes
                    del out
            del src
        else:
            from safetensors import safe_open

            backend = "pread" if reader == "pkg_pread" else "mmap"
            for fname, names in by_file.items():
                path = Path(args.src) / fname
                groups = [[n] for n in names] if reader == "pkg_mmap_reopen" else [names]
                for group in groups:              # reopen: one open (one map) per tensor
                    with safe_open(path, framework="numpy", backend=backend) as f:
                        for n in group:
                            shape = tuple(ckpt.info(n).shape)
                            if 0 in shape:       # the package cannot slice a zero-size tensor
                                continue
                            t = f.get_slice(n)
                            for sl in _row_slices(shape, whole):
                                out = t[sl]
                                total += out.nbytes
                                del out
        passes.append(time.perf_counter() - t0)
    peak = max(convert._peak_rss() - rss0, 0)
    return {"bytes": total, "pass_seconds": passes, "peak_rss_delta": peak}


def io_write(args) -> dict:
    """Every tensor of ``args.src`` (names, dtypes, shapes; bytes from a random buffer, copied
    fresh per tensor as a conversion produces them) written to ``args.dst`` by ``args.experts``
    (``ours`` / ``pkg``), shards capped at 5 GB."""
    import numpy as np

    from kdsa.train.convert import pipeline as convert
    from kdsa.train.convert import safetensors_io as sio

    ckpt = sio.SafetensorsCheckpoint(args.src)
    infos = [ckpt.info(n) for n in ckpt.names()]
    buf = np.random.default_rng(0).integers(0, 255, max(i.nbytes for i in infos), np.uint8)
    specs = [sio.TensorSpec(i.name, i.np_dtype, i.shape,
                            lambda i=i: buf[:i.nbytes].view(i.np_dtype).reshape(i.shape).copy())
             for i in infos]
    dst = Path(args.dst)
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    cap = 5 * 10**9
    rss0 = convert._rss_now()
    passes = []
    for _ in range(IO_PASSES):
        t0 = time.perf_counter()
        if args.experts == "ours":
            total = sio.write_checkpoint(dst, specs, max_shard_bytes=cap)
        else:
            from safetensors.numpy import save_file

            shards = sio.plan_shards(specs, cap)
            total = 0
            for fname, shard in zip(sio.shard_file_names(len(shards)), shards):
                save_file({s.name: s.produce() for s in shard}, dst / fname)
                total += (dst / fname).stat().st_size
        passes.append(time.perf_counter() - t0)
    peak = max(convert._peak_rss() - rss0, 0)
    back = sio.SafetensorsCheckpoint(dst)          # both files read back equal
    for s in specs:
        if not np.array_equal(back.tensor(s.name).view(np.uint8), s.produce().view(np.uint8)):
            raise SystemExit(f"{args.experts}: {s.name} read back differs")
    shutil.rmtree(dst, ignore_errors=True)
    return {"bytes": total, "pass_seconds": passes, "peak_rss_delta": peak}


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


def warm(path: Path) -> None:
    """Read every file once, so each reader starts from the same (warm) page cache."""
    for p in sorted(path.glob("*.safetensors")):
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def io_compare(hf: Path, root: Path) -> dict:
    """Our safetensors reader / writer next to the ``safetensors`` package (module docstring);
    ``{}`` without the package (``pip install -e .[test]``)."""
    from kdsa.train.convert.safetensors_io import SafetensorsCheckpoint

    import importlib.util

    if importlib.util.find_spec("safetensors") is None:
        print("safetensors I/O: skipped (no safetensors package; it is in the test extra)")
        return {}

    c = SafetensorsCheckpoint(hf)
    largest = max(c.info(n).nbytes for n in c.names())
    res: dict = {"largest_tensor_bytes": largest, "row_slices": IO_SLICES, "passes": IO_PASSES,
                 "read": {}, "write": {}}

    def entry(r: dict) -> dict:
        return {"mb_per_s": r["bytes"] / 1e6 / min(r["pass_seconds"]),
                "first_pass_mb_per_s": r["bytes"] / 1e6 / r["pass_seconds"][0],
                "bytes": r["bytes"], "peak_rss_delta_bytes": r["peak_rss_delta"],
                "peak_rss_over_largest_tensor": r["peak_rss_delta"] / largest}

    for mode in ("whole", "rows"):
        for reader in IO_READERS:
            warm(hf)
            res["read"][f"{mode}/{reader}"] = entry(run_child("io_read", src=hf, experts=reader,
                                                              dst=mode))
    for writer in ("ours", "pkg"):
        res["write"][writer] = entry(run_child("io_write", src=hf, dst=root / f"io_{writer}",
                                               experts=writer))
    print(f"safetensors I/O (largest tensor {largest / 1e6:.0f} MB):")
    for k, v in list(res["read"].items()) + [(f"write/{k}", v) for k, v in res["write"].items()]:
        print(f"  {k:<21} {v['mb_per_s']:7.0f} MB/s (first pass {v['first_pass_mb_per_s']:5.0f})"
              f"  peak RSS +{v['peak_rss_delta_bytes'] / 2**20:.0f} MiB"
              f" ({v['peak_rss_over_largest_tensor']:.2f}x the largest tensor)")
    return res


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
    ap.add_argument("--io-only", action="store_true",
                    help="only the safetensors reader / writer comparison (merged into the "
                    "results)")
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
        io = io_compare(hf, root)
        if args.io_only:
            out = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
            if io:
                out["safetensors_io"] = dict(io, quick=args.quick, source_bytes=total)
            RESULTS.write_text(json.dumps({**out, "machine": _machine()}, indent=2) + "\n")
            print(f"wrote {RESULTS}")
            return
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
        if io:
            out["safetensors_io"] = dict(io, quick=args.quick, source_bytes=total)
        for k in r:
            print(f"{k:<18} {mbps[k]:8.1f} MB/s  {r[k]['seconds']:6.2f} s  peak RSS "
                  f"+{r[k]['peak_rss_delta'] / 2**20:.0f} MiB "
                  f"({r[k]['peak_rss_delta'] / largest:.2f}x the largest parameter)")
        print(f"hf->orbax / raw read {out['ratio_hf_to_orbax_vs_raw_read']:.3f}, / raw write "
              f"{out['ratio_hf_to_orbax_vs_raw_write']:.3f}; orbax->hf / raw write "
              f"{out['ratio_orbax_to_hf_vs_raw_write']:.3f}")
        print(f"MXFP4 expert tensors / bf16: {ratio_mxfp4:.4f} (4.25/16 = 0.2656)")
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({**out, "machine": _machine()}, indent=2) + "\n")
        print(f"wrote {RESULTS}")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
