"""Routed experts on CPU: a blocked grouped matmul and a batched every-expert product.

Both compute what :func:`kdsa.model.moe.experts_ragged` computes,
``y_n = sum_j w_nj * w2_e(act(w1_e z_n, w3_e z_n))`` with ``e = topk_idx[n, j]``, and take its
arguments. They exist because XLA:CPU lowers ``jax.lax.ragged_dot`` to a masked dense product
over every group (E times the FLOPs) and first copies the stacked ``[E, De, I]`` weights into the
layout that product wants: at ``k3-slice`` widths (De 3584, I 3072, E 4, top-2) the ragged
forward takes 4.2x a plain matmul chain over the same ``N*k`` rows at N = 1024, and a decode
step's routed experts cost ~200 ms for 176 MB of weights per matrix (``bench/bench_moe.py``).

* :func:`experts_blocked`: the ``M = N*k`` assignments are sorted by expert and each expert's
  rows padded to a multiple of ``block`` rows, so every block belongs to one expert and each
  expert's blocks are one contiguous run. A loop over experts slices each expert's weights
  once and loops over its own blocks; unused blocks are never visited. FLOPs are the routed
  FLOPs plus the padding (at most ``E * (block - 1)`` rows). Its VJP (:func:`_ffn_blocks`)
  loops the same way, summing an expert's weight gradients locally and writing them once.
  Two earlier forms measured slower: JAX's default transpose of a weight closed over by a scan
  adds a whole ``[E, De, I]`` array per block (fwd+bwd 3.9 s against 2.3 s for the plain
  chain at the shape above), and a flat scan over blocks indexing ``w1[e]`` per block made
  XLA:CPU copy the expert's matrices for every block.
* :func:`experts_batched`: every token through every expert, with the expert as the batch
  dimension of one product, so each expert's weights are read once where they lie. E/k times
  the routed FLOPs; for decode, where reading the weights is the cost.

:func:`experts_cpu` picks one by the token count (crossover measured in
``bench/bench_moe.py``; ``docs/performance.md``). Tests: ``tests/test_experts_cpu.py`` against
:func:`kdsa.model.moe.experts_one_hot`, values and gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kdsa.model.activations import gated_activation
from kdsa.model.config import ModelConfig
from kdsa.model.layers import inverse_permutation

# experts_batched computes N * E rows; at or below this many it beats the blocked scan.
BATCHED_MAX_ROWS = 1024
MAX_BLOCK_ROWS = 256


def block_rows(m: int, e: int) -> int:
    """Rows per block for ``m`` assignments over ``e`` experts: the power of two nearest below
    ``m / (2 e)`` (about two blocks per expert on average, so padding stays under half the
    work), clipped to ``[8, MAX_BLOCK_ROWS]``."""
    target = max(1, m // (2 * e))
    return int(min(MAX_BLOCK_ROWS, max(8, 1 << (target.bit_length() - 1))))


def experts_cpu(z: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, w1: jax.Array,
                w3: jax.Array, w2: jax.Array, config: ModelConfig) -> jax.Array:
    """:func:`experts_batched` when its ``N * E`` rows are at most ``BATCHED_MAX_ROWS`` and the
    experts are at most twice the assignments (decode: reading every expert's weights once
    beats a block per used expert), else :func:`experts_blocked`. At ``k3-slice`` widths
    (E 4, top-2) batched is 3.0x faster at N = 8, 1.45x at 128, even at 256 and 1.2x slower at
    512 (``bench/bench_moe.py``)."""
    n, k = topk_idx.shape
    e = w1.shape[0]
    if n * e <= BATCHED_MAX_ROWS and e <= 2 * n * k:
        return experts_batched(z, topk_idx, topk_weight, w1, w3, w2, config)
    return experts_blocked(z, topk_idx, topk_weight, w1, w3, w2, config)


def experts_batched(z: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, w1: jax.Array,
                    w3: jax.Array, w2: jax.Array, config: ModelConfig) -> jax.Array:
    """Every token through every expert as ``[E, N, .]`` batched products; ``[N, De]``."""
    e = w1.shape[0]
    dt = z.dtype
    combine = jnp.einsum("nke,nk->en", jax.nn.one_hot(topk_idx, e, dtype=jnp.float32),
                         topk_weight.astype(jnp.float32))  # [E, N]
    x = jnp.broadcast_to(z, (e,) + z.shape)  # [E, N, De]
    gate = jnp.einsum("end,edi->eni", x, w1.astype(dt))  # [E, N, I]
    up = jnp.einsum("end,edi->eni", x, w3.astype(dt))
    out = jnp.einsum("eni,eid->end", gated_activation(gate, up, config), w2.astype(dt))
    return jnp.einsum("end,en->nd", out.astype(jnp.float32), combine).astype(dt)


def experts_blocked(z: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, w1: jax.Array,
                    w3: jax.Array, w2: jax.Array, config: ModelConfig, *,
                    block: int | None = None) -> jax.Array:
    """Blocked grouped matmul over expert-sorted assignments (module docstring); ``[N, De]``.

    ``block``: rows per block (default :func:`block_rows`).
    """
    n, k = topk_idx.shape
    e, de, _ = w1.shape
    m = n * k
    b = block or block_rows(m, e)
    nb = (m + e * (b - 1)) // b  # blocks enough for any split of m rows over e experts
    flat = topk_idx.reshape(-1).astype(jnp.int32)  # [M]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # [M] assignments by expert
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)  # [E]
    starts = jnp.cumsum(sizes) - sizes  # [E] first sorted row of each expert
    padded = (sizes + b - 1) // b * b  # [E]
    padded_ends = jnp.cumsum(padded)  # [E]
    padded_starts = padded_ends - padded
    block_start = jnp.arange(nb, dtype=jnp.int32) * b  # [nb]
    block_expert = jnp.minimum(jnp.searchsorted(padded_ends, block_start, side="right"),
                               e - 1).astype(jnp.int32)  # [nb]
    block_used = block_start < padded_ends[-1]  # [nb]
    # Padded slot p -> sorted row (or padding): gathers only, no scatter.
    slot = jnp.arange(nb * b, dtype=jnp.int32)  # [P]
    slot_expert = jnp.repeat(block_expert, b)  # [P]
    offset = slot - padded_starts[slot_expert]  # [P]
    valid = (offset < sizes[slot_expert]) & jnp.repeat(block_used, b)  # [P]
    sorted_row = jnp.where(valid, starts[slot_expert] + offset, 0)  # [P]
    token = jnp.take(order, sorted_row) // k  # [P]
    rows = jnp.where(valid[:, None], jnp.take(z, token, axis=0), 0).reshape(nb, b, de)
    y = _ffn_blocks(config, rows, padded_starts // b, padded // b, w1.astype(z.dtype),
                    w3.astype(z.dtype), w2.astype(z.dtype)).reshape(nb * b, de)  # [P, De]
    # Sorted row j sits in slot padded_starts[expert] + (j - starts[expert]).
    sorted_expert = jnp.take(flat, order)  # [M]
    dest = padded_starts[sorted_expert] + jnp.arange(m, dtype=jnp.int32) - starts[sorted_expert]
    out_sorted = jnp.take(y, dest, axis=0)  # [M, De]
    out = jnp.take(out_sorted, inverse_permutation(order), axis=0).reshape(n, k, de)
    return jnp.einsum("nkd,nk->nd", out.astype(jnp.float32),
                      topk_weight.astype(jnp.float32)).astype(z.dtype)


# ---------------------------------------------------------------------------------------------
# The per-block FFN and its VJP
# ---------------------------------------------------------------------------------------------
#
# Both loop over experts, then over the expert's own run of blocks (module docstring): a flat
# scan indexing ``w1[e]`` per block made XLA:CPU copy the expert's matrices for every block,
# ~12 ms each at k3-slice widths (docs/performance.md, MoE dispatch).

def _block_forward(config, x, w1, w3, w2):
    """One block: ``(gate, up, out)`` for rows ``x [B, De]`` through one expert's weights."""
    gate, up = x @ w1, x @ w3  # [B, I]
    return gate, up, gated_activation(gate, up, config) @ w2  # [B, De]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ffn_blocks(config, rows, block_first, block_count, w1, w3, w2):
    """``rows [nb, B, De]`` -> ``[nb, B, De]``: expert e's blocks are
    ``block_first[e] .. block_first[e] + block_count[e] - 1``; other blocks give zeros."""
    return _ffn_blocks_fwd(config, rows, block_first, block_count, w1, w3, w2)[0]


def _ffn_blocks_fwd(config, rows, block_first, block_count, w1, w3, w2):
    nb, b, de = rows.shape
    i = w1.shape[-1]
    dt = rows.dtype

    def expert(e, carry):
        we = (w1[e], w3[e], w2[e])  # sliced once per expert

        def block(j, carry):
            gate, up, out = carry
            g, u, o = _block_forward(config, rows[j], *we)
            return (gate.at[j].set(g), up.at[j].set(u), out.at[j].set(o))
        lo = block_first[e]
        return jax.lax.fori_loop(lo, lo + block_count[e], block, carry)

    init = (jnp.zeros((nb, b, i), dt), jnp.zeros((nb, b, i), dt), jnp.zeros_like(rows))
    gate, up, out = jax.lax.fori_loop(0, w1.shape[0], expert, init)
    return out, (rows, gate, up, block_first, block_count, w1, w3, w2)


def _ffn_blocks_bwd(config, residuals, d_out):
    rows, gate, up, block_first, block_count, w1, w3, w2 = residuals

    def expert(e, carry):
        d_rows, d1, d3, d2 = carry
        w1e, w3e, w2e = w1[e], w3[e], w2[e]

        def block(j, acc):
            d_rows, g1, g3, g2 = acc
            x, dy = rows[j], d_out[j]
            h, act_vjp = jax.vjp(lambda g, u: gated_activation(g, u, config), gate[j], up[j])
            dg, du = act_vjp(dy @ w2e.T)  # [B, I]
            dx = dg @ w1e.T + du @ w3e.T  # [B, De]
            f32 = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)
            return (d_rows.at[j].set(dx), g1 + f32(x.T, dg), g3 + f32(x.T, du), g2 + f32(h.T, dy))
        lo = block_first[e]
        # an expert's weight gradients summed over its blocks in float32 (a bf16 running sum
        # rounds once per block), cast once
        zeros = lambda w: jnp.zeros(w.shape, jnp.float32)  # noqa: E731
        d_rows, g1, g3, g2 = jax.lax.fori_loop(
            lo, lo + block_count[e], block, (d_rows, zeros(w1e), zeros(w3e), zeros(w2e)))
        return (d_rows, d1.at[e].set(g1.astype(d1.dtype)), d3.at[e].set(g3.astype(d3.dtype)),
                d2.at[e].set(g2.astype(d2.dtype)))

    init = (jnp.zeros_like(rows), jnp.zeros_like(w1), jnp.zeros_like(w3), jnp.zeros_like(w2))
    d_rows, d1, d3, d2 = jax.lax.fori_loop(0, w1.shape[0], expert, init)
    return d_rows, None, None, d1, d3, d2


_ffn_blocks.defvjp(_ffn_blocks_fwd, _ffn_blocks_bwd)
