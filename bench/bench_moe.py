"""Routed-expert dispatch against a dense FFN of the same active FLOPs.

Times, side by side on the same inputs (forward, and forward + backward where asked):

* ``routed``: what the MoE layer runs on this platform (``experts_routed``: on CPU
  ``experts_cpu``, the blocked scan or the batched every-expert product; on GPU/TPU
  ``ragged_dot``);
* ``blocked`` and ``batched``: the two CPU paths on their own;
* ``ragged``: ``jax.lax.ragged_dot`` (XLA:CPU lowers it to a masked dense product over every
  expert);
* ``one_hot``: the dense reference;
* ``floor``: a dense FFN over the same ``N*k`` rows (every row through expert 0), the FLOPs
  of a perfect grouped matmul. Issue #21's target: routed / floor <= 1.5.

Cases: the ``k3-slice`` expert widths (latent 3584 -> 3072, 4 experts top-2) at decode sizes
(N 8, 128), a prefill chunk (512) and a training batch (1024, with backward); ``--quick``: N 8
and 512 forward only. Writes bench/results/moe_dispatch.json.

    .venv/bin/python bench/bench_moe.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kdsa.model.activations import gated_activation  # noqa: E402
from kdsa.model.config import get_preset  # noqa: E402
from kdsa.model.experts_cpu import experts_batched, experts_blocked  # noqa: E402
from kdsa.model.moe import experts_one_hot, experts_ragged, experts_routed  # noqa: E402
from kdsa.model.routing import route  # noqa: E402
from timing import seconds, write_results  # noqa: E402


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
    """Same row count and FLOPs as a perfect grouped matmul (every row uses expert 0): a dense
    FFN of the routed experts' active FLOPs."""
    n, k = idx.shape
    w1_0, w3_0, w2_0 = w1[0], w3[0], w2[0]
    rows = jnp.repeat(z, k, axis=0)  # [N*k, De]
    h = gated_activation(rows @ w1_0, rows @ w3_0, config)
    return jnp.einsum("nkd,nk->nd", (h @ w2_0).reshape(n, k, -1), wt)


PATHS = {"routed": experts_routed, "blocked": experts_blocked, "batched": experts_batched,
         "ragged": experts_ragged, "one_hot": experts_one_hot, "floor": floor_fn}


def bench_case(n, e, k, de, i, paths, backward: bool, reps: int) -> dict:
    c, args = make_case(n, e, k, de, i)
    z, idx, wt, w1, w3, w2 = args
    out = {}
    for name in paths:
        f = PATHS[name]
        fwd = jax.jit(lambda *a, f=f: f(*a, c))
        out[name] = {"fwd_s": seconds(fwd, *args, reps=reps)}
        if backward:
            def loss(z, w1, w3, w2, idx, wt, f=f):
                return jnp.sum(f(z, idx, wt, w1, w3, w2, c) ** 2)
            bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
            out[name]["fwd_bwd_s"] = seconds(bwd, z, w1, w3, w2, idx, wt, reps=reps)
        print(f"  N={n} {name:8s} " + "  ".join(f"{p} {v * 1e3:8.1f} ms"
                                               for p, v in out[name].items()), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N 8 and 512, forward only")
    p.add_argument("--out", type=Path,
                   default=Path(__file__).parent / "results" / "moe_dispatch.json")
    args = p.parse_args()
    k3 = get_preset("k3-slice")
    e, k, de, i = (k3.num_experts, k3.num_experts_per_token, k3.expert_hidden_size,
                   k3.moe_intermediate_size)
    all_paths = ("routed", "blocked", "batched", "ragged", "floor")
    cases = [(8, all_paths, False), (512, all_paths, False)]
    if not args.quick:
        cases = [(8, all_paths, False), (128, all_paths, False), (512, all_paths, False),
                 (1024, ("routed", "ragged", "one_hot", "floor"), True)]
    rows = []
    for n, paths, backward in cases:
        t = bench_case(n, e, k, de, i, paths, backward, reps=2 if backward else 3)
        row = {"N": n, "E": e, "k": k, "De": de, "I": i, "times": t}
        for phase in t["floor"]:
            for name in paths:
                if name != "floor":
                    row[f"{name}_over_floor_{phase[:-2]}"] = t[name][phase] / t["floor"][phase]
            row[f"ragged_over_routed_{phase[:-2]}"] = t["ragged"][phase] / t["routed"][phase]
        rows.append(row)
        print(f"N={n}: routed/floor {row['routed_over_floor_fwd']:.2f}x fwd"
              + (f", {row['routed_over_floor_fwd_bwd']:.2f}x fwd+bwd" if backward else "")
              + f"; ragged/routed {row['ragged_over_routed_fwd']:.2f}x fwd", flush=True)
    write_results(args.out, {"device": str(jax.devices()[0]), "quick": args.quick,
                             "preset_widths": "k3-slice", "rows": rows})


if __name__ == "__main__":
    main()
