"""Generation throughput: decode tokens/s vs batch size and vs context length, hybrid (KDA +
Gated DSA) vs the same model with every attention layer dense MLA (``index_topk=None``), and
prefill tokens/s. One run, side by side; prints ratios and writes bench/results/generate.json.

Decode is timed on the engine's compiled step (``ModelRunner.decode``, every slot active at the
given context position, cache preallocated to ``max_len``), so a row costs what a slot costs
in serving: KDA layers are constant per token, DSA layers read ``index_topk`` selected keys of
the latent cache plus the indexer over all keys, dense MLA reads all keys. The end-to-end row
runs ``Engine.generate`` (sampling, host bookkeeping) at one batch size.

    python bench/bench_generate.py [--quick] [--preset small]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from kdsa.infer.engine import Engine, Request  # noqa: E402
from kdsa.infer.runner import ModelRunner  # noqa: E402
from kdsa.infer.sampling import SamplingParams  # noqa: E402
from kdsa.infer.tokenizer import ByteTokenizer  # noqa: E402
from kdsa.model.config import get_preset  # noqa: E402
from kdsa.model.transformer import Transformer  # noqa: E402


def _time(fn, reps: int) -> float:
    """Best of ``reps`` timed calls after a warm-up (the minimum resists other load on a
    shared CPU)."""
    jax.block_until_ready(fn())  # compile / warm
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def decode_tps(model, batch: int, context: int, reps: int) -> float:
    runner = ModelRunner(model, num_slots=batch, max_len=context + 1, prefill_chunk=16)
    toks = np.ones(batch, np.int32)
    pos = np.full(batch, context - 1, np.int32)  # attend over `context` slots
    act = np.ones(batch, bool)
    return batch / _time(lambda: runner.decode(toks, pos, act), reps)


def prefill_tps(model, length: int, reps: int) -> float:
    runner = ModelRunner(model, num_slots=1, max_len=length, prefill_chunk=length)
    ids = list(range(1, length + 1))
    return length / _time(lambda: runner.prefill(0, ids, 0), reps)


def engine_tps(model, batch: int, new: int) -> float:
    runner = ModelRunner(model, num_slots=batch, max_len=64 + new, prefill_chunk=64)
    eng = Engine(runner, ByteTokenizer(model.config.vocab_size))
    reqs = lambda: [Request([1 + i] * 32, SamplingParams(temperature=0.8, max_tokens=new,  # noqa
                                                         ignore_eos=True, seed=i))
                    for i in range(batch)]
    eng.generate(reqs()[:1])  # compile
    t0 = time.perf_counter()
    out = eng.generate(reqs())
    return sum(len(c.token_ids) for c in out) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--preset", default=None, help="default: small (tiny with --quick)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "generate.json"))
    args = ap.parse_args()
    args.preset = args.preset or ("tiny" if args.quick else "small")
    batches = [1, 8, 64] if args.quick else [1, 4, 16, 64]
    contexts = [1024, 8192] if args.quick else [1024, 4096, 16384, 32768]
    cfg = get_preset(args.preset)
    cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings,
                                                  max(contexts) + 1))
    reps = 5 if args.quick else 10
    models = {"hybrid_dsa": Transformer(cfg, rngs=nnx.Rngs(0)),
              "dense_mla": Transformer(cfg.replace(index_n_heads=None, index_head_dim=None,
                                                   index_topk=None), rngs=nnx.Rngs(0))}
    res: dict = {"preset": args.preset, "backend": jax.default_backend(),
                 "devices": len(jax.devices()), "quick": args.quick,
                 "index_topk": cfg.index_topk, "decode_vs_batch": {}, "decode_vs_context": {},
                 "prefill": {}}
    ctx_b = 1024
    print(f"{args.preset} on {jax.default_backend()}: decode tokens/s (hybrid vs dense MLA)")
    for b in batches:
        row = {k: decode_tps(m, b, ctx_b, reps) for k, m in models.items()}
        row["ratio"] = row["hybrid_dsa"] / row["dense_mla"]
        res["decode_vs_batch"][b] = row
        print(f"  batch {b:3d} @ ctx {ctx_b}: hybrid {row['hybrid_dsa']:9.1f}  dense "
              f"{row['dense_mla']:9.1f}  ratio {row['ratio']:.2f}", flush=True)
    for c in contexts:
        row = {k: decode_tps(m, 1, c, reps) for k, m in models.items()}
        row["ratio"] = row["hybrid_dsa"] / row["dense_mla"]
        res["decode_vs_context"][c] = row
        print(f"  ctx {c:6d} @ batch 1: hybrid {row['hybrid_dsa']:9.1f}  dense "
              f"{row['dense_mla']:9.1f}  ratio {row['ratio']:.2f}", flush=True)
    for length in ([256, 1024] if args.quick else [256, 1024, 4096]):
        row = {k: prefill_tps(m, length, reps) for k, m in models.items()}
        row["ratio"] = row["hybrid_dsa"] / row["dense_mla"]
        res["prefill"][length] = row
        print(f"  prefill {length:5d}: hybrid {row['hybrid_dsa']:9.1f}  dense "
              f"{row['dense_mla']:9.1f} tokens/s  ratio {row['ratio']:.2f}", flush=True)
    b = 8
    res["engine_end_to_end"] = {"batch": b, "tokens_per_s": engine_tps(
        models["hybrid_dsa"], b, 16 if args.quick else 64)}
    print(f"  engine (sampling + scheduling) batch {b}: "
          f"{res['engine_end_to_end']['tokens_per_s']:.1f} tokens/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
