"""Routed-expert dispatch: dropless ``ragged_dot`` vs the one-hot dense reference.

Times ``experts_ragged`` and ``experts_one_hot`` (forward, and forward + backward) side by side
on the same inputs, plus a "floor": one plain matmul chain over the same ``N*k`` rows (the
FLOPs a perfect grouped matmul would do). Prints time ratios one-hot / ragged and
ragged / floor per size, and writes bench/results/moe_dispatch.json.

On CPU XLA lowers ``ragged_dot`` to a masked dense matmul over all E groups, so ragged is not
expected to beat one-hot there; on GPU/TPU it is a grouped matmul and the ratio should grow
with E / k.

    .venv/bin/python bench/bench_moe.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kdsa.model.activations import gated_activation  # noqa: E402
from kdsa.model.config import get_preset  # noqa: E402
from kdsa.model.moe import experts_one_hot, experts_ragged, route  # noqa: E402


def make_case(n: int, e: int, k: int, de: int, i: int):
    c = get_preset("small").replace(num_experts=e, num_experts_per_token=k, hidden_size=de,
                                    routed_expert_hidden_size=None, moe_intermediate_size=i)
    ks = jax.random.split(jax.random.key(0), 5)
    z = jax.random.normal(ks[0], (n, de), jnp.float32)
    router = jax.random.normal(ks[1], (de, e), jnp.float32) * de ** -0.5
    idx, wt, _ = route(z, router, jnp.zeros((e,), jnp.float32), c)
    w1 = jax.random.normal(ks[2], (e, de, i), jnp.float32) * de ** -0.5
    w3 = jax.random.normal(ks[3], (e, de, i), jnp.float32) * de ** -0.5
    w2 = jax.random.normal(ks[4], (e, i, de), jnp.float32) * i ** -0.5
    return c, (z, idx, wt, w1, w3, w2)


def floor_fn(z, idx, wt, w1, w3, w2, config):
    """Same row count and FLOPs as a perfect grouped matmul (every row uses expert 0)."""
    n, k = idx.shape
    rows = jnp.repeat(z, k, axis=0)  # [N*k, De]
    h = gated_activation(rows @ w1[0], rows @ w3[0], config)
    return jnp.einsum("nkd,nk->nd", (h @ w2[0]).reshape(n, k, -1), wt)


def seconds(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def bench_case(n, e, k, de, i, iters):
    c, args = make_case(n, e, k, de, i)
    out = {}
    for name, f in (("ragged", experts_ragged), ("one_hot", experts_one_hot), ("floor", floor_fn)):
        fwd = jax.jit(lambda *a, f=f: f(*a, c))
        def loss(z, w1, w3, w2, idx, wt, f=f):
            return jnp.sum(f(z, idx, wt, w1, w3, w2, c) ** 2)
        bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        z, idx, wt, w1, w3, w2 = args
        out[name] = {"fwd_s": seconds(fwd, args, iters),
                     "fwd_bwd_s": seconds(bwd, (z, w1, w3, w2, idx, wt), iters)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one size, few iterations")
    args = p.parse_args()
    sizes = [(1024, 16, 4, 128, 128)]
    if not args.quick:
        sizes += [(2048, 64, 4, 128, 128)]
    iters = 3 if args.quick else 5
    rows = []
    for n, e, k, de, i in sizes:
        t = bench_case(n, e, k, de, i, iters)
        row = {"N": n, "E": e, "k": k, "De": de, "I": i, "times": t}
        for phase in ("fwd_s", "fwd_bwd_s"):
            row[f"one_hot_over_ragged_{phase[:-2]}"] = t["one_hot"][phase] / t["ragged"][phase]
            row[f"ragged_over_floor_{phase[:-2]}"] = t["ragged"][phase] / t["floor"][phase]
        rows.append(row)
        print(f"N={n} E={e} k={k} De={de} I={i}: one-hot/ragged fwd "
              f"{row['one_hot_over_ragged_fwd']:.2f}x, fwd+bwd "
              f"{row['one_hot_over_ragged_fwd_bwd']:.2f}x; ragged/floor fwd "
              f"{row['ragged_over_floor_fwd']:.2f}x, fwd+bwd "
              f"{row['ragged_over_floor_fwd_bwd']:.2f}x",
              flush=True)
    out = Path(__file__).parent / "results" / "moe_dispatch.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"device": str(jax.devices()[0]), "quick": args.quick,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
