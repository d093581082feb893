"""Batched prefill against one slot at a time (issue #18 section 3), side by side in one run.

``--requests`` requests of ``--prompt`` tokens arrive together at an engine with as many slots
(the paged cache, prefix caching off so every run prefills everything). One engine prefills a
chunk of every slot with prompt left in one step (``ModelRunner(batch_prefill=True)``,
``kdsa serve --batched-prefill``), the other one slot at a time. Both are warmed up first
(every bucket and row count compiled, the time reported apart), then the same workload runs
``--reps`` times on each, alternating: mean TTFT, time until every request has its first
token, and total wall time with ``--decode`` tokens each. Results in
bench/results/batched_prefill.json.

    python bench/bench_batched_prefill.py [--quick] [--requests 8] [--prompt 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).parent))
from timing import write_results  # noqa: E402


def build(a, batched: bool):
    from flax import nnx

    from kdsa.infer.engine import Engine
    from kdsa.infer.runner import ModelRunner
    from kdsa.infer.tokenizer import ByteTokenizer
    from kdsa.model.config import get_preset
    from kdsa.model.paged_cache import pages_for
    from kdsa.model.transformer import Transformer

    cfg = get_preset(a.preset)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    max_len = a.prompt + a.decode + 64
    runner = ModelRunner(model, num_slots=a.requests, max_len=max_len,
                         prefill_chunk=a.prefill_chunk,
                         num_pages=a.requests * pages_for(max_len), batch_prefill=batched)
    t0 = time.perf_counter()
    runner.warmup()
    warm = time.perf_counter() - t0
    engine = Engine(runner, ByteTokenizer(cfg.vocab_size), max_top_logprobs=0,
                    prefill_tokens_per_step=a.budget)
    return engine, warm


def run(engine, a, rep: int) -> dict:
    import numpy as np

    from kdsa.infer.engine import Request
    from kdsa.infer.sampling import SamplingParams

    rng = np.random.default_rng(rep)
    reqs = [Request(rng.integers(0, 256, a.prompt).tolist(),
                    SamplingParams(temperature=0.0, max_tokens=a.decode, ignore_eos=True))
            for _ in range(a.requests)]
    t0 = time.perf_counter()
    done = engine.generate(reqs)
    wall = time.perf_counter() - t0
    ttft = [c.metrics.ttft_s for c in done]
    return {"mean_ttft_s": statistics.mean(ttft), "last_first_token_s": max(ttft),
            "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 requests of 256 tokens, 2 reps")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--budget", type=int, default=None,
                   help="prompt tokens per engine step (default: the engine's, 4 chunks)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                        "batched_prefill.json"))
    a = p.parse_args()
    if a.quick:
        a.requests, a.prompt, a.reps = 4, 256, 2
    engines = {}
    result = {"args": vars(a), "load_before": os.getloadavg(), "warmup_s": {}}
    # one slot first: the batched runner shares its one-slot programs (same model structure),
    # so its warm-up time is what batching adds (a program per row count and bucket)
    for name, batched in (("one_slot", False), ("batched", True)):
        print(f"building and warming up {name} ...", flush=True)
        engines[name], result["warmup_s"][name] = build(a, batched)
    runs = {k: [] for k in engines}
    for rep in range(a.reps):  # alternate: both see the same load
        for name, engine in sorted(engines.items()):
            runs[name].append(run(engine, a, rep))
    result["runs"] = runs
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    result["median"] = med
    result["one_slot_over_batched"] = {m: med["one_slot"][m] / med["batched"][m]
                                       for m in med["batched"]}
    result["batched_steps"] = engines["batched"].metrics()["batched_prefill_steps"]
    result["load_after"] = os.getloadavg()
    for m, r in result["one_slot_over_batched"].items():
        print(f"{m:>18}: batched {med['batched'][m]:.3f} s, one slot {med['one_slot'][m]:.3f}"
              f" s: {r:.2f}x")
    print(f"warm-up: batched {result['warmup_s']['batched']:.1f} s, one slot "
          f"{result['warmup_s']['one_slot']:.1f} s")
    write_results(a.out, result)


if __name__ == "__main__":
    main()
