"""References and input checks for the sparse MLA attention kernel (no model code).

Problem (DeepSeek-V3.2 sparse attention, absorbed MQA form; FlashMLA ``flash_mla_sparse_fwd``
semantics): query ``t`` of row ``b``, head ``n``, attends to the ``K`` key rows its index set
names,

    out[t, n] = sum_k softmax_k(sm_scale * q[t, n] . kv[idx[t, k]]) kv[idx[t, k], :v_dim]

with slots outside ``[0, S)`` skipped, a duplicated index counted twice, and a query with no
valid slot giving out 0 and lse -inf. Two references along different paths:

* :func:`sparse_mla_attention_ref`: gather the selected rows per query chunk, masked softmax
  (O(T K Dk N); what ``impl="xla"`` runs);
* :func:`dense_masked_mla_attention`: full ``[T, S]`` scores plus ``log`` of the index
  multiplicities (DeepSeek's dense-mask formulation, O(T S)).

The model's own XLA path (``kdsa.model.dsa.sparse_mla_attention``) is a third, tested against
both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["sparse_mla_attention_ref", "dense_masked_mla_attention", "check_inputs"]

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)
f32 = jnp.float32


def check_inputs(q: jax.Array, kv, indices: jax.Array, v_dim: int,
                 name: str = "sparse_mla_attention") -> tuple[jax.Array, ...]:
    """Validate ``q [B, T, N, Dk]``, ``kv [B, S, Dk]`` or parts ``[B, S, D_i]`` with
    ``sum D_i = Dk``, ``indices [B, T, K]`` integer and ``0 < v_dim <= Dk``; return the parts."""
    if q.ndim != 4 or q.dtype not in _FLOATS:
        raise ValueError(f"{name}: q must be float [B, T, N, Dk], got {q.dtype}{list(q.shape)}")
    b, t, _, dk = q.shape
    parts = tuple(kv) if isinstance(kv, (tuple, list)) else (kv,)
    shapes = [tuple(p.shape) for p in parts]
    if (not parts or any(len(sh) != 3 or sh[:2] != shapes[0][:2] for sh in shapes)
            or shapes[0][0] != b or sum(sh[2] for sh in shapes) != dk):
        raise ValueError(f"{name}: kv must be [B, S, Dk] = [{b}, S, {dk}] (or parts whose last "
                         f"dims add up to Dk), got {shapes}")
    if any(p.dtype not in _FLOATS for p in parts):
        raise ValueError(f"{name}: kv must be float, got {[str(p.dtype) for p in parts]}")
    if (indices.ndim != 3 or indices.shape[:2] != (b, t)
            or not jnp.issubdtype(indices.dtype, jnp.integer)):
        raise ValueError(f"{name}: indices must be integer [B, T, K] = [{b}, {t}, K], got "
                         f"{indices.dtype}{list(indices.shape)}")
    if not 0 < v_dim <= dk:
        raise ValueError(f"{name}: v_dim={v_dim} must be in (0, Dk={dk}]")
    return parts


def _masked_softmax_attend(logits: jax.Array, values: jax.Array, spec: str):
    """Softmax over the last axis of ``logits`` (-inf = masked) applied to ``values`` by the
    einsum ``spec``; ``(out, lse)`` with out 0 and lse -inf where nothing is visible."""
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1)
    safe = jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum(spec, p, values) / safe[..., None]
    return out, jnp.where(denom > 0, m[..., 0] + jnp.log(safe), -jnp.inf)


def sparse_mla_attention_ref(q: jax.Array, kv, indices: jax.Array, sm_scale: float, v_dim: int,
                             *, chunk_size: int = 256) -> tuple[jax.Array, jax.Array]:
    """The kernel's signature: out ``[B, T, N, v_dim]`` float32, lse ``[B, T, N]``.

    kv ``[B, S, Dk]`` or parts that concatenate to ``Dk`` (joined once here); queries in chunks
    of ``chunk_size`` so no more than ``[B, C, K, Dk]`` gathered rows exist at a time."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    parts = check_inputs(q, kv, indices, v_dim, "sparse_mla_attention_ref")
    whole = jnp.concatenate([p.astype(f32) for p in parts], axis=-1)   # [B, S, Dk]
    b, t, n, dk = q.shape
    s, k = whole.shape[1], indices.shape[2]
    c = min(chunk_size, t)
    chunks = -(-t // c)
    pad = chunks * c - t
    q_c = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, chunks, c, n, dk)
    i_c = jnp.pad(indices, ((0, 0), (0, pad), (0, 0)), constant_values=-1).reshape(
        b, chunks, c, k)

    def one_chunk(args):
        qc, ic = args                                                    # [B, C, N, Dk], [B, C, K]
        valid = (ic >= 0) & (ic < s)
        rows = jax.vmap(lambda w, i: w[i])(whole, jnp.where(valid, ic, 0))   # [B, C, K, Dk]
        rows = jnp.where(valid[..., None], rows, 0.0)  # unused slots: zeros, not row 0's values
        logits = jnp.einsum("bcnd,bckd->bcnk", qc.astype(f32), rows) * sm_scale
        logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
        return _masked_softmax_attend(logits, rows[..., :v_dim], "bcnk,bckd->bcnd")

    out, lse = jax.lax.map(one_chunk, (jnp.moveaxis(q_c, 1, 0), jnp.moveaxis(i_c, 1, 0)))
    out = jnp.moveaxis(out, 0, 1).reshape(b, chunks * c, n, v_dim)[:, :t]
    lse = jnp.moveaxis(lse, 0, 1).reshape(b, chunks * c, n)[:, :t]
    return out, lse


def dense_masked_mla_attention(q: jax.Array, kv: jax.Array, indices: jax.Array, sm_scale: float,
                               v_dim: int) -> tuple[jax.Array, jax.Array]:
    """The same problem as full ``[B, T, N, S]`` scores: the index set becomes a multiplicity
    matrix ``C[t, s] = #{k : idx[t,k] = s}`` (one-hot sum) and the softmax is taken of
    ``scores + log C`` (``log 0 = -inf``), which counts duplicates like the gather does."""
    s = kv.shape[1]
    counts = jnp.sum(jax.nn.one_hot(indices, s, dtype=f32), axis=2)      # [B, T, S]; -1: none
    logits = jnp.einsum("btnd,bsd->btns", q.astype(f32), kv.astype(f32)) * sm_scale
    logits = logits + jnp.where(counts > 0, jnp.log(jnp.maximum(counts, 1.0)),
                                -jnp.inf)[:, :, None, :]
    return _masked_softmax_attend(logits, kv[..., :v_dim].astype(f32), "btns,bsd->btnd")
