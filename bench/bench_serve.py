"""Serving agent sessions through the HTTP server, prefix cache on and off (issue #18 section 5).

Three measurements, one run, side by side; results in bench/results/serve.json:

1. **Agent sessions** (``kdsa serve`` in a subprocess, concurrent clients over HTTP, streamed
   ``/v1/chat/completions``): every session starts with a system prompt shared by all sessions
   and a long first user message of its own (a file to work on); each turn the client resends
   the whole history plus the model's last reply (content and reasoning, as returned) and a new
   tool result of a few hundred tokens, until the history reaches ``--history`` tokens. TTFT per
   turn (request sent -> first streamed delta), the server's prefix-cache counters, total
   tokens/s; once with the prefix cache and once with ``--no-prefix-cache`` (same paged pool).
2. **Shared prefix** (shaped like SGLang's generated-shared-prefix): 16 groups x 8 prompts, each
   group's prompts share a 2K-token system prompt; sent in a shuffled order by 8 concurrent
   clients; mean TTFT, throughput and hit rate, cache on and off.
3. **Paged decode cost**: one compiled decode step, batch 8, every slot at 32K context, of the
   paged cache (``ModelRunner(num_pages=...)``, each slot's pages scattered over the pool) and
   of the dense-slot cache; median step time and the ratio (target >= 0.9).

The model is the ``tiny`` preset with random weights and the byte-level tokenizer (one token
per ASCII character). Its replies are random bytes: decoded to text (invalid UTF-8 replaced)
and resent, they do not re-tokenize to the ids the model generated, so a turn's hit stops at
the last snapshot before the reply (every ``--prefix-snapshot-every`` pages of the previous
prompt) rather than at the previous turn's exact end, as it would with a model whose replies
round-trip (the end-of-request snapshot, ``tests/test_prefix_cache.py``). The numbers are a
floor for what a trained model gets.

    python bench/bench_serve.py [--quick] [--history 16384] [--sessions 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).parent))
from timing import write_results  # noqa: E402

WORDS = ("alpha beta gamma delta file line value error test pass fail return index token "
         "cache page state layer model expert query key row column shape batch step").split()


def text(rng: random.Random, n: int) -> str:
    """About ``n`` ASCII characters (= byte tokens) of words."""
    out, size = [], 0
    while size < n:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``kdsa serve`` in a subprocess, up once ``/health`` answers."""

    def __init__(self, args: list[str], timeout: float = 900):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kdsa.cli.main", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kdsa serve exited: {self.proc.stderr.read()[-3000:]}")
            try:
                self.health()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("kdsa serve did not come up") from None
                time.sleep(1.0)

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
            return json.loads(r.read())

    def stream(self, body: dict, timeout: float = 900):
        """POST a streamed chat completion; yields each SSE chunk, parsed, as it arrives."""
        req = urllib.request.Request(self.url + "/v1/chat/completions",
                                     json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                yield chunk

    def chat(self, messages: list[dict], max_tokens: int) -> tuple[float, dict, float]:
        """Stream one chat completion: (TTFT s, the reply message, total s)."""
        t0 = time.perf_counter()
        ttft, content, reasoning = None, [], []
        for chunk in self.stream({"model": "kdsa", "messages": messages,
                                  "max_tokens": max_tokens, "temperature": 0,
                                  "reasoning_effort": "low"}):
            delta = chunk["choices"][0].get("delta", {}) if chunk.get("choices") else {}
            piece = (delta.get("content") or "", delta.get("reasoning_content") or "")
            if (piece[0] or piece[1]) and ttft is None:
                ttft = time.perf_counter() - t0
            content.append(piece[0])
            reasoning.append(piece[1])
        reply = {"role": "assistant", "content": "".join(content)}
        if "".join(reasoning):
            reply["reasoning_content"] = "".join(reasoning)
        return ttft if ttft is not None else time.perf_counter() - t0, reply, \
            time.perf_counter() - t0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def history_tokens(messages: list[dict]) -> int:
    """Characters of the messages (byte tokenizer: about the prompt's tokens, less markers)."""
    return sum(len(m.get("content", "")) + len(m.get("reasoning_content", "")) for m in messages)


def agent_sessions(server: Server, a) -> dict:
    """Concurrent sessions, each turn the whole history resent; TTFT per turn."""
    shared = text(random.Random(0), a.system)
    rows: list[dict] = []
    lock = threading.Lock()

    def session(s: int) -> None:
        rng = random.Random(100 + s)
        messages = [{"role": "system", "content": shared},
                    {"role": "user", "content": "Fix the failing test in this file:\n"
                     + text(rng, a.first)}]
        turn = 0
        while history_tokens(messages) <= a.history:
            turn += 1
            ttft, reply, total = server.chat(messages, a.reply)
            with lock:
                rows.append({"session": s, "turn": turn, "history": history_tokens(messages),
                             "ttft_s": ttft, "request_s": total})
            messages += [reply, {"role": "user", "content": "Tool result:\n"
                                 + text(rng, a.tool)}]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=session, args=(s,)) for s in range(a.sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    by_turn = {}
    for r in rows:
        by_turn.setdefault(r["turn"], []).append(r)
    turns = [{"turn": t, "history": statistics.mean(r["history"] for r in rs),
              "ttft_s": statistics.median(r["ttft_s"] for r in rs)}
             for t, rs in sorted(by_turn.items())]
    return {"wall_s": wall, "requests": len(rows), "turns": turns,
            "prompt_tokens": sum(r["history"] for r in rows), "server": server.health()}


def shared_prefix(server: Server, a) -> dict:
    """16 groups x 8 prompts sharing a system prompt per group, 8 clients, shuffled."""
    rng = random.Random(1)
    systems = [text(rng, a.group_system) for _ in range(a.groups)]
    jobs = [(g, text(rng, 96)) for g in range(a.groups) for _ in range(a.per_group)]
    rng.shuffle(jobs)
    ttfts, lock, it = [], threading.Lock(), iter(jobs)

    def client() -> None:
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            ttft, _, _ = server.chat([{"role": "system", "content": systems[job[0]]},
                                      {"role": "user", "content": job[1]}], a.reply)
            with lock:
                ttfts.append(ttft)

    before = server.health()["metrics"].get("prefix_cache", {})
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(len(systems[g]) + len(q) for g, q in jobs)
    after = server.health()
    pc = after["metrics"].get("prefix_cache", {})
    hit = pc.get("hit_tokens", 0) - before.get("hit_tokens", 0)
    queried = pc.get("queried_tokens", 0) - before.get("queried_tokens", 0)
    return {"wall_s": wall, "requests": len(jobs), "mean_ttft_s": statistics.mean(ttfts),
            "median_ttft_s": statistics.median(ttfts), "prompt_tokens_per_s": tokens / wall,
            "hit_rate": hit / queried if queried else None, "server": after}


def paged_decode(a) -> dict:
    """Median decode step, batch ``a.decode_batch`` at ``a.decode_context``: paged vs dense."""
    import jax
    import numpy as np
    from flax import nnx

    from kdsa.infer.runner import ModelRunner
    from kdsa.model.config import get_preset
    from kdsa.model.paged_cache import pages_for
    from kdsa.model.transformer import Transformer

    model = Transformer(get_preset(a.preset), rngs=nnx.Rngs(0))
    b, ctx = a.decode_batch, a.decode_context
    max_len = ctx + 64
    per = pages_for(max_len)
    dense = ModelRunner(model, num_slots=b, max_len=max_len, prefill_chunk=64)
    paged = ModelRunner(model, num_slots=b, max_len=max_len, prefill_chunk=64,
                        num_pages=b * per)
    order = np.random.default_rng(0).permutation(b * per)  # every slot's pages scattered
    for s in range(b):
        paged.set_pages(s, order[s * per:(s + 1) * per].tolist())
    tokens = np.ones(b, np.int32)
    pos = np.full(b, ctx - 1, np.int32)
    active = np.ones(b, bool)
    times = {"dense": [], "paged": []}
    for runner in (dense, paged):  # compile
        jax.block_until_ready(runner.decode(tokens, pos, active))
    for _ in range(a.decode_reps):  # alternate: both see the same load
        for name, runner in (("dense", dense), ("paged", paged)):
            t0 = time.perf_counter()
            jax.block_until_ready(runner.decode(tokens, pos, active))
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batch": b, "context": ctx, "dense_step_s": med["dense"],
            "paged_step_s": med["paged"],
            "paged_over_dense_tokens_per_s": med["dense"] / med["paged"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="histories to 4K, 4 groups, 4K decode")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--history", type=int, default=16384, help="grow histories to this size")
    p.add_argument("--system", type=int, default=2048, help="shared system prompt tokens")
    p.add_argument("--first", type=int, default=4096, help="first user message tokens")
    p.add_argument("--tool", type=int, default=400, help="tool result tokens per turn")
    p.add_argument("--reply", type=int, default=16, help="max_tokens per turn")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--group-system", type=int, default=2048)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-context", type=int, default=32768)
    p.add_argument("--decode-reps", type=int, default=10)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--prefix-snapshot-every", type=int, default=None,
                   help="the server's --prefix-snapshot-every (default: the server's)")
    p.add_argument("--cache-only", action="store_true",
                   help="only the prefix-cache runs (no comparison, no decode measurement)")
    p.add_argument("--decode-only", action="store_true",
                   help="only the paged vs dense decode measurement (no server)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve.json"))
    a = p.parse_args()
    if a.quick:
        a.history, a.first, a.groups, a.decode_context = 4096, 1024, 4, 4096
    max_len = a.history + a.first + a.tool + 4 * a.reply + 1024  # the last turn fits
    max_len = -(-max_len // 64) * 64
    pages = 2 * a.sessions * (max_len // 64)  # room to keep idle sessions' pages cached
    base = ["--preset", a.preset, "--slots", str(max(a.sessions, a.clients)), "--max-len",
            str(max_len), "--prefill-chunk", str(a.prefill_chunk), "--num-pages", str(pages),
            "--budget-low", "0", "--model-name", "kdsa"]
    if a.prefix_snapshot_every is not None:
        base += ["--prefix-snapshot-every", str(a.prefix_snapshot_every)]
    result = {"args": vars(a), "max_len": max_len, "num_pages": pages,
              "load_before": os.getloadavg()}
    if a.decode_only:
        show_decode(result.setdefault("paged_decode", paged_decode(a)))
        write_results(a.out, result)
        return
    modes = (("cache", []),) + ((("no_cache", ["--no-prefix-cache"]),) if not a.cache_only
                                else ())
    for name, extra in modes:
        print(f"serving with {name} ...", flush=True)
        server = Server(base + extra)
        try:
            result[f"sessions_{name}"] = agent_sessions(server, a)
            result[f"shared_prefix_{name}"] = shared_prefix(server, a)
        finally:
            server.stop()
    if a.cache_only:
        on = result["sessions_cache"]
        result["sessions_hit_rate"] = on["server"]["metrics"]["prefix_cache"]["hit_rate"]
        result["shared_prefix_hit_rate"] = result["shared_prefix_cache"]["hit_rate"]
        print(f"sessions: hit rate {result['sessions_hit_rate']:.3f}, wall {on['wall_s']:.1f} s,"
              f" TTFT by turn {[round(t['ttft_s'], 3) for t in on['turns']]}; shared prefix: "
              f"hit rate {result['shared_prefix_hit_rate']}, mean TTFT "
              f"{result['shared_prefix_cache']['mean_ttft_s']:.3f} s")
        write_results(a.out, result)
        return
    print("paged vs dense decode ...", flush=True)
    result["paged_decode"] = paged_decode(a)
    result["load_after"] = os.getloadavg()

    on, off = result["sessions_cache"], result["sessions_no_cache"]
    rows = []
    for t_on, t_off in zip(on["turns"], off["turns"]):
        rows.append({"turn": t_on["turn"], "history": round(t_on["history"]),
                     "ttft_cache_s": t_on["ttft_s"], "ttft_no_cache_s": t_off["ttft_s"],
                     "speedup": t_off["ttft_s"] / t_on["ttft_s"]})
    result["ttft_by_turn"] = rows
    pc = on["server"]["metrics"].get("prefix_cache", {})
    result["sessions_hit_rate"] = pc.get("hit_rate")
    result["sessions_throughput_ratio"] = off["wall_s"] / on["wall_s"]
    sp_on, sp_off = result["shared_prefix_cache"], result["shared_prefix_no_cache"]
    result["shared_prefix_ttft_speedup"] = sp_off["mean_ttft_s"] / sp_on["mean_ttft_s"]
    print(f"{'turn':>4} {'history':>8} {'TTFT cache':>11} {'no cache':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['turn']:>4} {r['history']:>8} {r['ttft_cache_s']:>10.3f}s "
              f"{r['ttft_no_cache_s']:>8.3f}s {r['speedup']:>7.1f}x")
    print(f"sessions: hit rate {result['sessions_hit_rate']}, wall {on['wall_s']:.1f} s vs "
          f"{off['wall_s']:.1f} s without the cache")
    print(f"shared prefix: mean TTFT {sp_on['mean_ttft_s']:.3f} s vs "
          f"{sp_off['mean_ttft_s']:.3f} s ({result['shared_prefix_ttft_speedup']:.1f}x), hit "
          f"rate {sp_on['hit_rate']}")
    show_decode(result["paged_decode"])
    write_results(a.out, result)


def show_decode(d: dict) -> None:
    print(f"decode batch {d['batch']} at {d['context']}: paged {d['paged_step_s'] * 1e3:.1f} ms"
          f", dense {d['dense_step_s'] * 1e3:.1f} ms, paged/dense tokens/s "
          f"{d['paged_over_dense_tokens_per_s']:.2f}")


if __name__ == "__main__":
    main()
