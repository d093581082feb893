"""A 128K-token agent session on the ``tiny`` preset, end to end (issue #18 section 6).

Two measurements, one run; results in bench/results/long_context.json:

1. **Served** (``kdsa serve`` in a subprocess, as a user runs it, one slot, the paged cache with
   prefix caching, ``--max-len`` past 128K with no other override): one streamed
   ``/v1/chat/completions`` request whose history is ``--context`` tokens (byte tokenizer: one
   token per ASCII character), ``--decode`` tokens out (``ignore_eos``). Prefill time (TTFT), decode tokens/s as
   the client sees them, and from ``/health``: the prompt's tokens, the most pool pages held at
   once against ``pages_for(prompt + output)`` (the computed bound of the DSA cache), the KDA
   state bytes per sequence (constant in context, from ``kdsa params``' formula) and the
   server's peak resident memory.
2. **Decode step against context**: the engine's compiled decode step (``ModelRunner.decode``,
   paged, batch 1) of one runner sized for ``--context`` tokens, with the request at 4K, 8K,
   ... up to the whole context, alternated rep by rep so all see the same load; median step
   times, the block-table width each reads (``ModelRunner.table_width``), and the ratio of the
   step at the whole context to the step at 4K (target: at most 1.5x); and the whole-pool
   ``copy`` ops in the compiled step's optimized HLO (0: the pools are written in place).

    python bench/bench_long_context.py [--quick] [--context 131072] [--decode 32]
    python bench/bench_long_context.py --step-only --preset small --out ...   # 2. alone
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import Server, text  # noqa: E402
from timing import write_results  # noqa: E402


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (``VmHWM``), 0 where /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def served_session(a, max_len: int) -> dict:
    """One long request through ``kdsa serve``: TTFT, decode rate, pages and memory."""
    from kdsa.model.config import get_preset
    from kdsa.model.kda_layer import kda_cache_bytes_per_sequence
    from kdsa.model.paged_cache import pages_for

    args = ["--preset", a.preset, "--slots", "1", "--max-len", str(max_len),
            "--prefill-chunk", str(a.prefill_chunk), "--budget-low", "0",
            "--model-name", "kdsa"]
    t0 = time.perf_counter()
    server = Server(args)
    startup = time.perf_counter() - t0
    try:
        history = text(random.Random(0), a.context - 256)  # room for the chat markers
        body = {"model": "kdsa", "messages": [{"role": "user", "content": history}],
                "max_tokens": a.decode, "temperature": 0, "reasoning_effort": "low",
                "ignore_eos": True, "logprobs": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        ttft, usage, last = None, None, None
        for chunk in server.stream(body, timeout=3600):
            if chunk.get("usage"):
                usage = chunk["usage"]
            choice = chunk["choices"][0] if chunk.get("choices") else {}
            if (choice.get("logprobs") or {}).get("content"):  # a chunk with tokens
                last = time.perf_counter()
                if ttft is None:
                    ttft = last - t0
        health = server.health()
        rss = peak_rss_bytes(server.proc.pid)
    finally:
        server.stop()
    m = health["metrics"]
    prompt, out = usage["prompt_tokens"], usage["completion_tokens"]
    cfg = get_preset(a.preset)
    n_kda = sum(k == "kda" for k in cfg.mixer_kinds)
    return {"startup_s": startup, "prompt_tokens": prompt, "completion_tokens": out,
            "ttft_s": ttft, "prefill_tokens_per_s": prompt / ttft,
            "decode_tokens_per_s": (out - 1) / (last - t0 - ttft) if out > 1 else None,
            "pages_peak": m["cache"]["pages_peak"], "pages_bound": pages_for(prompt + out),
            "pages_total": m["cache"]["pages_total"],
            "kda_state_bytes_per_sequence": n_kda * kda_cache_bytes_per_sequence(cfg),
            "server_peak_rss_bytes": rss, "engine": {k: m[k] for k in (
                "prefill_tokens", "decode_steps", "mean_decode_step_s", "preemptions")}}


def decode_against_context(a, max_len: int) -> dict:
    """Median decode step of one paged runner at 4K and at ``a.context`` tokens."""
    import jax
    import numpy as np
    from flax import nnx

    from kdsa.infer.page_pool import page_bytes
    from kdsa.model.dsa_cache import dsa_cache_bytes_per_token
    from kdsa.infer.runner import ModelRunner
    from kdsa.infer.runner_steps import is_pool
    from kdsa.model.config import get_preset
    from kdsa.model.paged_cache import SCRATCH_ROWS, pages_for
    from kdsa.model.transformer import Transformer

    model = Transformer(get_preset(a.preset), rngs=nnx.Rngs(0))
    pages = pages_for(max_len)
    runner = ModelRunner(model, num_slots=1, max_len=max_len, prefill_chunk=64,
                         num_pages=pages)
    runner.set_pages(0, np.random.default_rng(0).permutation(pages).tolist())  # scattered
    contexts = {str(c): c for c in (4096, 8192, 16384, 32768, 65536) if c < a.context}
    contexts[str(a.context)] = a.context
    times = {k: [] for k in contexts}
    one, active = np.ones(1, np.int32), np.ones(1, bool)
    for ctx in contexts.values():  # compile each context's block-table width before timing
        jax.block_until_ready(runner.decode(one, np.full(1, ctx - 1, np.int32), active))
    for _ in range(a.reps):
        for name, ctx in contexts.items():
            pos = np.full(1, ctx - 1, np.int32)
            t0 = time.perf_counter()
            jax.block_until_ready(runner.decode(one, pos, active))
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    # whole-pool copies in the compiled step (XLA's optimized HLO): 0 when the pools are
    # written in place (docs/serving.md)
    pools = [x for x in jax.tree.leaves(runner.cache, is_leaf=is_pool) if is_pool(x)]
    rows = pools[0].num_rows  # a layer's rows; a whole stack's [L, R, D] or [L * R, D] too
    flat = "|".join(sorted({str(p.kv_latent.shape[0] * rows) for p in pools}))
    args = runner._args(one, np.full(1, 4095, np.int32), active,
                        runner.block_table[:, :runner.table_width(64)].copy())
    hlo = runner._decode.lower(runner.decode_state(), runner.cache, *args).compile().as_text()
    pool_copies = sum(1 for line in hlo.splitlines() if " copy(" in line
                      and re.search(rf"[\[,]({rows}|{flat}),", line))
    # what the runner holds: the per-slot (KDA) leaves of one slot, and the DSA page pool
    per_slot = [x for x in jax.tree.leaves(runner.cache, is_leaf=is_pool) if not is_pool(x)]
    return {"max_len": max_len, "step_s": med, "pool_copies_per_step": pool_copies,
            "long_over_short": med[str(a.context)] / med["4096"],
            "table_pages_read": {k: runner.table_width(pages_for(c)) for k, c in contexts.items()},
            "runner_kda_state_bytes_per_slot": sum(x.nbytes for x in per_slot),
            "runner_pool_bytes": sum(x.nbytes for p in pools for x in jax.tree.leaves(p)),
            "pool_bytes_computed": pages * page_bytes(model.config)  # + each pool's scratch rows
            + SCRATCH_ROWS * sum(k != "kda" for k in model.config.mixer_kinds)
            * dsa_cache_bytes_per_token(model.config)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a 16K session")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--context", type=int, default=131072, help="session tokens")
    p.add_argument("--decode", type=int, default=32, help="tokens generated")
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--step-only", action="store_true",
                   help="only the decode step against context (no server)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                        "long_context.json"))
    a = p.parse_args()
    if a.quick:
        a.context, a.reps = 16384, 10
    max_len = a.context + a.decode
    result = {"args": vars(a), "max_len": max_len, "load_before": os.getloadavg()}
    if not a.step_only:
        print(f"serving a {a.context}-token session ...", flush=True)
        result["served"] = served_session(a, max_len)
    print("decode step at 4K vs the whole context ...", flush=True)
    result["decode"] = decode_against_context(a, max_len)
    result["load_after"] = os.getloadavg()
    s, d = result.get("served"), result["decode"]
    if s:
        print(f"served: {s['prompt_tokens']} prompt tokens, TTFT {s['ttft_s']:.1f} s "
              f"({s['prefill_tokens_per_s']:.0f} tokens/s), {s['completion_tokens']} tokens at "
              f"{s['decode_tokens_per_s'] or 0:.1f} tokens/s; pages peak {s['pages_peak']} "
              f"(bound {s['pages_bound']}), KDA state {s['kda_state_bytes_per_sequence']} B, "
              f"server peak RSS {s['server_peak_rss_bytes'] / 2**20:.0f} MiB")
    print("decode step: " + ", ".join(f"{float(v) * 1e3:.1f} ms at {k}"
                                      for k, v in d["step_s"].items())
          + f"; {a.context} / 4096: {d['long_over_short']:.2f}x; pool copies per step "
          f"{d['pool_copies_per_step']}")
    write_results(a.out, result)


if __name__ == "__main__":
    main()
