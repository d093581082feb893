"""KDA: chunked throughput (forward, forward+backward) vs tokamax, and decode-step time by context.

Measured side by side in one run, on the same inputs (B=1, H=4, K=V=64, float32, JAX's device):

* ours: ``kdsa.model.kda.kda_chunked`` (C=64) with the K3 lower-bound gate activation
  (``kda_layer.kda_gate``, lb=-5) in the same jit, told the bound (``gate_lower_bound=-5``: the
  bounded pair-product construction), and the same without the bound (``general``: the
  construction exact for any g <= 0, used by Kimi-Linear's softplus gate).
* peer: tokamax's pure-JAX chunked KDA (``tokamax._src.ops.kda.api.kimi_delta_attention``,
  ``implementation="xla_chunked"``, C=64), which requires the fused lower-bound gate, on the same
  raw gate, ``a_log`` and ``dt_bias`` (inputs pre-transposed to its [H, B, T, K] layout).
  If tokamax cannot be imported or run, the output and the JSON say so and no peer number exists.
* decode: one ``KDA`` layer step (T=1, cache donated) from a cache prefilled with 1K vs 64K
  tokens (``--quick``: 1K vs 16K). The state is constant size, so the ratio should be ~1.

Prints tokens/s and ratios ours/peer (> 1: ours faster) and writes bench/results/kda.json.
Each time is the minimum over --reps calls after a warm-up call (the JSON also keeps the
median and max: the spread). The CPU here is shared: the load average at start and end is
recorded with the numbers; ours and the peer are timed alternately, call by call, so that both
see the same load (forward functions among themselves, then forward+backward ones).

    .venv/bin/python bench/bench_kda.py [--quick] [--reps 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from kdsa.model.kda import kda_chunked  # noqa: E402
from kdsa.model.kda_layer import KDA, init_kda_cache, kda_gate  # noqa: E402
from kdsa.model.presets import small  # noqa: E402
from timing import write_results  # noqa: E402  (bench/timing.py; the script's folder)

H, K, LB = 4, 64, -5.0


def make_inputs(t: int, seed: int = 0):
    r = np.random.default_rng(seed)
    q, k = r.standard_normal((2, 1, t, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, raw, w = r.standard_normal((3, 1, t, H, K))
    beta = 1.0 / (1.0 + np.exp(-r.standard_normal((1, t, H))))
    a_log = r.uniform(-1.0, 1.0, (H,))
    dt_bias = r.uniform(-1.0, 1.0, (H * K,))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, raw, beta, w, a_log, dt_bias)]


def ours_fn(a_log, dt_bias, bound=LB):
    def run(q, k, v, raw, beta):
        g = kda_gate(raw + dt_bias.reshape(H, K), a_log, LB)
        return kda_chunked(q, k, v, g, beta, chunk_size=64, gate_lower_bound=bound)[0]
    return run


def peer_fn(a_log, dt_bias):
    from tokamax._src.ops.kda import api  # the peer, imported only here

    def run(q, k, v, raw, beta):
        o, _ = api.kimi_delta_attention(q, k, v, raw, beta, a_log=a_log, delta_time_bias=dt_bias,
                                        use_gate_in_kernel=True, lower_bound=LB,
                                        implementation="xla_chunked")
        return o
    return run


def fwd_bwd(fn, w):
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=(0, 1, 2, 3, 4)))


def interleaved_times(fns, reps):
    """Wall times of each ``(fn, args)`` in ``fns`` (name -> pair), the calls interleaved round by
    round so that every function sees the same load; one warm-up (compile) call each first."""
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, (fn, args) in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return times


def throughput(lengths, reps):
    rows, peer_error = [], None
    for t in lengths:
        q, k, v, raw, beta, w, a_log, dt_bias = make_inputs(t)
        args = (q, k, v, raw, beta)
        ours, general = ours_fn(a_log, dt_bias), ours_fn(a_log, dt_bias, bound=None)
        fns = {"ours_fwd": (jax.jit(ours), args), "ours_fwd_bwd": (fwd_bwd(ours, w), args),
               "general_fwd": (jax.jit(general), args),
               "general_fwd_bwd": (fwd_bwd(general, w), args)}
        row = {"T": t}
        if peer_error is None:
            try:
                peer = peer_fn(a_log, dt_bias)
                hb = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731  [B,T,H,..] -> [H,B,T,..]
                pargs = [hb(x) for x in args]
                o_peer = jax.jit(peer)(*pargs)
                row["max_abs_diff_vs_peer"] = float(jnp.max(jnp.abs(hb(jax.jit(ours)(*args))
                                                                    - o_peer)))
                fns["peer_fwd"] = (jax.jit(peer), pargs)
                fns["peer_fwd_bwd"] = (fwd_bwd(peer, hb(w)), pargs)
            except Exception as e:  # noqa: BLE001  the peer is optional: report why it is absent
                peer_error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        times = {}  # forward functions timed among themselves, then the backward ones: a
        # forward call right after a large fwd+bwd call ran measurably slower (cold caches)
        for mode in ("_fwd", "_fwd_bwd"):
            times |= interleaved_times({n: f for n, f in fns.items() if n.endswith(mode)}, reps)
        for name, ts in times.items():
            row[f"{name}_tok_s"] = t / min(ts)
            row[f"{name}_seconds_min_median_max"] = [min(ts), statistics.median(ts), max(ts)]
        if "peer_fwd" in times:
            for mode in ("fwd", "fwd_bwd"):
                for who in ("ours", "general"):
                    key = f"{mode}_ratio_{who}_over_peer"
                    row[key] = row[f"{who}_{mode}_tok_s"] / row[f"peer_{mode}_tok_s"]
        rows.append(row)
        peer = (f"peer fwd {row['peer_fwd_tok_s']:8.0f} fwd+bwd {row['peer_fwd_bwd_tok_s']:7.0f}"
                f" | ours/peer fwd {row['fwd_ratio_ours_over_peer']:.2f}"
                f" fwd+bwd {row['fwd_bwd_ratio_ours_over_peer']:.2f}"
                f" (general {row['fwd_ratio_general_over_peer']:.2f}"
                f" / {row['fwd_bwd_ratio_general_over_peer']:.2f})"
                f" | max|do| {row['max_abs_diff_vs_peer']:.1e}") if "peer_fwd" in times \
            else "peer: not run"
        print(f"T={t:6d} tok/s ours fwd {row['ours_fwd_tok_s']:8.0f} fwd+bwd "
              f"{row['ours_fwd_bwd_tok_s']:7.0f} (general {row['general_fwd_tok_s']:8.0f} / "
              f"{row['general_fwd_bwd_tok_s']:7.0f}) | {peer}", flush=True)
    if peer_error:
        print(f"peer (tokamax xla_chunked) unavailable: {peer_error}")
    return rows, peer_error


def decode(contexts, reps):
    """Median decode-step time per context, the contexts' steps interleaved to share any drift."""
    base = small()
    cfg = base.replace(linear_attn_config=dataclasses.replace(
        base.linear_attn_config, num_heads=H, head_dim=K))
    graphdef, params = nnx.split(KDA(cfg, rngs=nnx.Rngs(0)))
    run = lambda p, x, c: nnx.merge(graphdef, p)(x, cache=c)  # noqa: E731
    prefill = jax.jit(run)
    step = jax.jit(run, donate_argnums=2)
    x_t = jnp.asarray(np.random.default_rng(1).standard_normal((1, 1, cfg.hidden_size)),
                      jnp.float32)
    caches = {}
    for ctx in contexts:
        x = jnp.asarray(np.random.default_rng(ctx).standard_normal((1, ctx, cfg.hidden_size)),
                        jnp.float32)
        _, caches[ctx] = prefill(params, x, init_kda_cache(cfg, 1))
        y, caches[ctx] = step(params, x_t, caches[ctx])                 # compile + warm up
        jax.block_until_ready(y)
    times = {ctx: [] for ctx in contexts}
    for _ in range(max(reps, 50)):
        for ctx in contexts:
            t0 = time.perf_counter()
            y, caches[ctx] = step(params, x_t, caches[ctx])
            jax.block_until_ready(y)
            times[ctx].append(time.perf_counter() - t0)
    out = {ctx: statistics.median(ts) for ctx, ts in times.items()}
    for ctx in contexts:
        print(f"decode step (KDA layer D={cfg.hidden_size} H={H} K={K}) after {ctx:6d} tokens: "
              f"{out[ctx] * 1e6:8.1f} us", flush=True)
    lo, hi = min(contexts), max(contexts)
    ratio = out[hi] / out[lo]
    print(f"decode time ratio context {hi} / {lo}: {ratio:.2f} (constant-size state: ~1)")
    return {"layer": {"hidden_size": cfg.hidden_size, "num_heads": H, "head_dim": K},
            "step_seconds_by_context": {str(c): s for c, s in out.items()},
            "ratio_longest_over_shortest": ratio}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T = 1K, 4K; decode at 1K vs 16K")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    lengths = (1024, 4096) if args.quick else (1024, 4096, 16384)
    contexts = (1024, 16384) if args.quick else (1024, 65536)
    load0 = os.getloadavg()[0]
    print(f"device {jax.devices()[0].platform}, B=1 H={H} K=V={K} float32, C=64, lb={LB}; "
          f"load average {load0:.1f} on {os.cpu_count()} CPUs")
    rows, peer_error = throughput(lengths, args.reps)
    dec = decode(contexts, args.reps)
    result = {
        "bench": "kda", "quick": args.quick, "device": jax.devices()[0].platform,
        "shape": {"B": 1, "H": H, "K": K, "V": K, "dtype": "float32", "chunk_size": 64,
                  "gate": f"lower bound {LB}", "ours": f"gate_lower_bound={LB}",
                  "general": "gate_lower_bound=None"},
        "throughput": rows,
        "peer": {"name": "tokamax xla_chunked kimi_delta_attention",
                 "available": peer_error is None, "error": peer_error},
        "decode": dec,
        "load_average": {"start": load0, "end": os.getloadavg()[0], "cpus": os.cpu_count()},
        "timing": "tok/s from the minimum wall time of --reps calls after a warm-up call, "
                  "all functions of one T interleaved call by call; decode: median",
    }
    path = Path(__file__).parent / "results" / "kda.json"
    write_results(path, result)


if __name__ == "__main__":
    main()
