"""Generation throughput: decode tokens/s vs batch size and vs context length, and prefill
tokens/s, of the hybrid (KDA + Gated DSA) against the same hybrid with its DSA layers made dense
(``hybrid_dense_dsa``: the indexer off, ``index_n_heads = index_head_dim = index_topk = None``,
so those layers run dense gated MLA over every key; the KDA layers, the MoE and everything else
unchanged). This isolates what the indexer and top-k selection cost or save; it is not a
comparison with an all-MLA model. One run, side by side; prints ratios and writes
bench/results/generate.json.

Decode is timed on the engine's compiled step (``ModelRunner.decode``, every slot active at the
given context position, cache preallocated to the context), so a row costs what a slot costs
in serving: KDA layers (the same in both models) are constant per token; the hybrid's DSA
layers read ``index_topk`` selected keys of the latent cache plus the indexer over all keys, the
baseline's dense layers read all keys. Each (batch, context) shape compiles once per model; in
a row one model's reps run, then the other's, back to back (best of the reps each), so a load
change between them moves the ratio. The end-to-end row runs
``Engine.generate`` (sampling, host bookkeeping) of the hybrid at one batch size. The load
average is recorded before and after: on a shared CPU the absolute tokens/s are upper-bound
noisy, the ratios (hybrid / dense-DSA baseline) much less so.

    python bench/bench_generate.py [--quick] [--preset tiny] [--topk 2048]

The full grid (batch 1..64 at 1K, context 1K..32K at batch 1, prefill 256..4096) takes about
10 minutes on 2 loaded CPU cores with the ``tiny`` preset and K3's top-2048 (the default):
DSA selects everything below 2K, so the grid shows both sides of the crossover.
"""

from __future__ import annotations

import argparse
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
from kdsa.progress import Progress  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from timing import write_results  # noqa: E402


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
    """Tokens/s of one decode step with ``batch`` slots, each attending over ``context``."""
    runner = ModelRunner(model, num_slots=batch, max_len=context, prefill_chunk=16)
    toks = np.ones(batch, np.int32)
    pos = np.full(batch, context - 1, np.int32)  # the last slot: attend over `context` keys
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


def grid(quick: bool) -> dict:
    if quick:
        return {"batches": [1, 8, 64], "contexts": [1024, 8192], "prefill": [256, 1024],
                "reps": 5, "engine_new": 16}
    return {"batches": [1, 2, 4, 8, 16, 32, 64],
            "contexts": [1024, 2048, 4096, 8192, 16384, 32768],
            "prefill": [256, 1024, 4096], "reps": 25, "engine_new": 64}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a 3 x 2 grid (about 2 minutes)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--topk", type=int, default=None,
                    help="index_topk of the hybrid model (default: K3's 2048; the preset's "
                         "own with --quick)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "generate.json"))
    args = ap.parse_args()
    g = grid(args.quick)
    cfg = get_preset(args.preset)
    topk = args.topk or (cfg.index_topk if args.quick else 2048)
    cfg = cfg.replace(index_topk=topk, max_position_embeddings=max(
        cfg.max_position_embeddings, max(g["contexts"]) + 1, max(g["prefill"])))
    # the baseline: the same hybrid (same config and seed) with its DSA layers made dense
    dense_dsa = cfg.replace(index_n_heads=None, index_head_dim=None, index_topk=None)
    models = {"hybrid_dsa": Transformer(cfg, rngs=nnx.Rngs(0)),
              "hybrid_dense_dsa": Transformer(dense_dsa, rngs=nnx.Rngs(0))}
    load0 = os.getloadavg()
    res: dict = {"preset": args.preset, "backend": jax.default_backend(),
                 "devices": len(jax.devices()), "quick": args.quick, "index_topk": topk,
                 "baseline": "hybrid_dense_dsa: the same hybrid with its DSA layers made dense "
                             "(indexer off, dense MLA attention)",
                 "load_average_before": load0, "decode_vs_batch": {}, "decode_vs_context": {},
                 "prefill": {}}
    t_start = time.perf_counter()
    ctx_b = g["contexts"][0]
    total = len(g["batches"]) + len(g["contexts"]) + len(g["prefill"]) + 1
    bar = Progress(total, unit="row")
    lines, done = [], 0

    def row(fn, *a):
        r = {k: fn(m, *a) for k, m in models.items()}
        r["ratio"] = r["hybrid_dsa"] / r["hybrid_dense_dsa"]
        return r

    def note(line):
        nonlocal done
        lines.append(line)
        done += 1
        bar.advance_to(done, desc=line.strip()[:60])

    for b in g["batches"]:
        r = res["decode_vs_batch"][b] = row(decode_tps, b, ctx_b, g["reps"])
        note(f"  batch {b:3d} @ ctx {ctx_b:5d}: hybrid {r['hybrid_dsa']:9.1f}  dense-DSA "
             f"{r['hybrid_dense_dsa']:9.1f}  ratio {r['ratio']:.2f}")
    for c in g["contexts"]:
        r = (res["decode_vs_batch"][1] if c == ctx_b and 1 in g["batches"]
             else row(decode_tps, 1, c, g["reps"]))
        res["decode_vs_context"][c] = r
        note(f"  ctx {c:6d} @ batch 1: hybrid {r['hybrid_dsa']:9.1f}  dense-DSA "
             f"{r['hybrid_dense_dsa']:9.1f}  ratio {r['ratio']:.2f}")
    for n in g["prefill"]:
        r = res["prefill"][n] = row(prefill_tps, n, 2 if n > 1024 else 3)
        note(f"  prefill {n:5d}: hybrid {r['hybrid_dsa']:9.1f}  dense-DSA "
             f"{r['hybrid_dense_dsa']:9.1f} tokens/s  ratio {r['ratio']:.2f}")
    b = 8
    res["engine_end_to_end"] = {"batch": b, "new_tokens": g["engine_new"], "tokens_per_s":
                                engine_tps(models["hybrid_dsa"], b, g["engine_new"])}
    note(f"  engine (sampling + scheduling) batch {b}: "
         f"{res['engine_end_to_end']['tokens_per_s']:.1f} tokens/s")
    bar.close()
    res["load_average_after"] = os.getloadavg()
    res["seconds"] = time.perf_counter() - t_start
    print(f"{args.preset} (index_topk {topk}) on {jax.default_backend()}: tokens/s, hybrid vs "
          f"the same hybrid with its DSA layers dense (dense-DSA); load average "
          f"{load0[0]:.1f} -> {res['load_average_after'][0]:.1f}, {res['seconds']:.0f} s")
    print("\n".join(lines))
    write_results(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
