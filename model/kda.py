"""Kimi Delta Attention (KDA) maths: the recurrence, its chunkwise-parallel WY/UT form, one step.

Per head, the state ``S [K, V]`` (float32) is updated per token (Kimi Linear, arXiv 2510.26692,
the constrained DPLR transition; fla ``fla/ops/kda/naive.py``; ``docs/reference/kda.md`` §1)::

    S <- diag(exp(g_t)) S                          g_t [K] log-decay, <= 0
    S <- S + beta_t k_t (v_t - S^T k_t)^T           beta_t in (0, 1)
    o_t = S^T (scale * q_t)                         read after the update, scale = K**-0.5

Layouts follow fla: ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``, ``beta [B, T, H]``, states
``[B, H, K, V]`` float32. All maths is float32 with ``precision=HIGHEST`` einsums; outputs come back
in ``v.dtype``. ``g`` and ``beta`` arrive already activated; q/k normalisation is the caller's.

Packed documents: ``segment_ids [B, T]`` int32. Equal positive ids form one document; id 0 is
padding, an exact no-op (beta = 0, g = 0 there, output 0). A *boundary* is a nonzero id that differs
from the last nonzero id before it; there the state restarts from zero. ``initial_state`` feeds only
the first document of each row. A reset is the limit g = -inf, so the chunked form realises it by
masking the decay exponents of cross-document pairs to -inf *before* ``exp``.

``kda_chunk_affine`` gives a sequence piece's map ``S -> M S + B`` for sequence parallelism.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kdsa.model.kda_chunk import bounded_block, chunk_cumsum, pair_products, unit_lower_inverse

_HI = lax.Precision.HIGHEST
# kda_chunked works through sequences longer than this many chunks in pieces of at most this many,
# the state carried by a scan: each piece's intermediates (pair products, UT inverse, W/U: about
# 1 MB per head at C=64) stay in cache. Measured (bench/bench_kda.py shapes, 2-core CPU): the
# forward at T=4K / 16K runs in 25 / 95 ms instead of 58 / 214 ms whole, outputs bit-identical.
SEGMENT_CHUNKS = 8


def _ein(eq: str, *xs: jax.Array) -> jax.Array:
    return jnp.einsum(eq, *xs, precision=_HI, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------
# Input checks and document boundaries
# ----------------------------------------------------------------------------------------------

def _check(q, k, v, g, beta, state=None, segment_ids=None, *, step: bool = False) -> None:
    lead = "[B, H, K]" if step else "[B, T, H, K]"
    nd = 3 if step else 4
    if q.ndim != nd:
        raise ValueError(f"q must be {lead}, got shape {q.shape}")
    for name, x in (("k", k), ("g", g)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {q.shape}, got {x.shape}")
    if v.ndim != nd or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"v must be {lead[:-2]}V] matching q {q.shape}, got {v.shape}")
    if beta.shape != q.shape[:-1]:
        raise ValueError(f"beta must have shape {q.shape[:-1]}, got {beta.shape}")
    if not step and q.shape[1] < 1:
        raise ValueError(f"the sequence is empty: q has shape {q.shape}")
    want = (q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1])
    if state is not None and state.shape != want:
        raise ValueError(f"state must be [B, H, K, V] = {want}, got {state.shape}")
    if segment_ids is not None:
        if segment_ids.shape != q.shape[:2] or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integer [B, T] = {q.shape[:2]}, got "
                             f"{segment_ids.dtype}{list(segment_ids.shape)}")


def segment_starts(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Document structure of ``segment_ids [B, T]``.

    Returns ``reset [B, T]`` bool (the token starts a new document after an earlier one in its
    row: the state restarts there), ``seg [B, T]`` int32 (running count of resets: the document
    index within the row, 0 for the one ``initial_state`` feeds; padding keeps the count of the
    last real token) and ``valid [B, T]`` bool (id != 0).
    """
    ids = segment_ids.astype(jnp.int32)
    b, t = ids.shape
    valid = ids != 0
    last = lax.cummax(jnp.where(valid, jnp.arange(t), -1), axis=1)  # last id'd position [B, T]
    prev = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), last[:, :-1]], axis=1)
    prev_id = jnp.where(prev >= 0, jnp.take_along_axis(ids, jnp.maximum(prev, 0), axis=1), 0)
    reset = valid & (prev_id != 0) & (ids != prev_id)
    return reset, jnp.cumsum(reset, axis=1, dtype=jnp.int32), valid


def _inputs(q, k, v, g, beta, segment_ids):
    """float32 copies with padding made a no-op; plus reset, seg, valid (None without ids)."""
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    if segment_ids is None:
        return q, k, v, g, beta, None, None, None
    reset, seg, valid = segment_starts(segment_ids)
    beta = jnp.where(valid[..., None], beta, 0.0)
    g = jnp.where(valid[..., None, None], g, 0.0)
    return q, k, v, g, beta, reset, seg, valid


# ----------------------------------------------------------------------------------------------
# The recurrence: definition and one decode step
# ----------------------------------------------------------------------------------------------

def _step(s, q, k, v, g, beta, scale):
    """One token. s [B,H,K,V] f32; q, k, g [B,H,K]; v [B,H,V]; beta [B,H] -> (o [B,H,V], s)."""
    s = s * jnp.exp(g)[..., None]                                   # decay first
    pred = _ein("bhkv,bhk->bhv", s, k)                              # S^T k
    s = s + _ein("bhk,bhv->bhkv", k, beta[..., None] * (v - pred))  # delta-rule write
    return _ein("bhkv,bhk->bhv", s, scale * q), s


def kda_step(q, k, v, g, beta, state, scale=None):
    """One decode token: ``q, k, g [B,H,K]``, ``v [B,H,V]``, ``beta [B,H]``, ``state [B,H,K,V]``.

    Returns ``(o [B,H,V] in v.dtype, new_state float32)``; exactly one step of ``kda_recurrent``.
    """
    _check(q, k, v, g, beta, state, step=True)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    f32 = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    o, s = _step(state.astype(jnp.float32), *f32, scale)
    return o.astype(v.dtype), s


def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None, segment_ids=None):
    """Token-by-token definition (``lax.scan`` over T): ``(o [B,T,H,V], final [B,H,K,V])``."""
    _check(q, k, v, g, beta, initial_state, segment_ids)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    qf, kf, vf, gf, bf, reset, _, valid = _inputs(q, k, v, g, beta, segment_ids)
    keep = jnp.ones((b, t), jnp.float32) if reset is None else 1.0 - reset.astype(jnp.float32)
    s0 = (jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))

    def body(s, xs):
        q_t, k_t, v_t, g_t, b_t, keep_t = xs
        o_t, s = _step(s * keep_t[:, None, None, None], q_t, k_t, v_t, g_t, b_t, scale)
        return s, o_t

    tm = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731  time-major for the scan
    s, o = lax.scan(body, s0, tuple(map(tm, (qf, kf, vf, gf, bf, keep))))
    o = jnp.moveaxis(o, 0, 1)                                       # [B, T, H, V]
    if valid is not None:
        o = jnp.where(valid[..., None, None], o, 0.0)
    return o.astype(v.dtype), s


# ----------------------------------------------------------------------------------------------
# Chunkwise-parallel form
# ----------------------------------------------------------------------------------------------

def _chunk_terms(q, k, v, g, beta, seg, chunk_size, scale, gate_lower_bound=None, seg_prev=None):
    """Everything that does not depend on the incoming state, for all chunks in parallel.

    Inputs [B,T,...] float32 (T a multiple of C), seg [B,T] int32 or None (one document per row);
    seg_prev [B]: the document index of the token before the piece (default 0, the incoming
    state's document).
    Returns chunk-major tensors (leading axis N): W [N,B,H,C,K], U [N,B,H,C,V], kt [N,B,H,C,K]
    (k_i * exp(G_C - G_i)), gl [N,B,H,K] (exp(G_C), 0 if the chunk resets), qh [N,B,H,C,K]
    (scale q_r exp(G_r), 0 outside the incoming document), aqk [N,B,H,C,C].
    """
    b, t, h, dk = q.shape
    n, c = t // chunk_size, chunk_size
    tr = lambda x: jnp.moveaxis(x.reshape(b, n, c, h, *x.shape[3:]), (1, 3), (0, 2))  # noqa: E731
    q, k, v, g, beta = map(tr, (q, k, v, g, beta))                    # [N, B, H, C, (K)]
    cg = chunk_cumsum(g)                                               # chunk-local only
    p = pair_products(jnp.stack([scale * q, k], axis=-3), k, cg, gate_lower_bound)
    aqk, akk = p[..., 0, :, :], p[..., 1, :, :]                        # [N, B, H, C, C]
    gam = jnp.exp(cg)                                                  # [N, B, H, C, K]
    if seg is not None:                                                # document masks
        seg = jnp.moveaxis(seg.reshape(b, n, c), 1, 0)[:, :, None]     # [N, B, 1, C]
        first = (jnp.zeros_like(seg[:1, ..., -1]) if seg_prev is None
                 else seg_prev.astype(seg.dtype)[None, :, None])      # [1, B, 1]
        seg_in = jnp.concatenate([first, seg[:-1, ..., -1]])
        same = (seg[..., :, None] == seg[..., None, :]).astype(jnp.float32)  # [N, B, 1, C, C]
        aqk, akk = aqk * same, akk * same
        gam = gam * (seg == seg_in[..., None]).astype(jnp.float32)[..., None]
        last_doc = (seg == seg[..., -1:]).astype(jnp.float32)[..., None]
        keep = (seg[..., -1] == seg_in).astype(jnp.float32)[..., None]  # [N, B, 1, 1]
    a = beta[..., None] * akk * jnp.tril(jnp.ones((c, c), jnp.float32), -1)
    rhs = jnp.concatenate([gam * k, v], axis=-1) * beta[..., None]     # [N, B, H, C, K+V]
    wu = _ein("...ij,...jd->...id", unit_lower_inverse(a), rhs)         # UT transform
    w, u = wu[..., :dk], wu[..., dk:]
    kt = k * jnp.exp(cg[..., -1:, :] - cg)
    gl = jnp.exp(cg[..., -1, :])
    if seg is not None:
        kt, gl = kt * last_doc, gl * keep
    return w, u, kt, gl, scale * q * gam, aqk


def _pad_to_chunks(chunk_size, q, k, v, g, beta, segment_ids):
    """Right-pad T to a multiple of C with exact no-op tokens (beta = 0, g = 0).

    Returns the float32 inputs, seg [B, T'] (None without ``segment_ids``) and valid [B, T]."""
    b, t = q.shape[:2]
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    pad = -t % chunk_size
    qf, kf, vf, gf, bf, _, seg, valid = _inputs(q, k, v, g, beta, segment_ids)
    if pad:
        z = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        qf, kf, vf, gf, bf = map(z, (qf, kf, vf, gf, bf))
        seg = None if seg is None else jnp.pad(seg, [(0, 0), (0, pad)], mode="edge")
    return qf, kf, vf, gf, bf, seg, valid


def kda_chunked(q, k, v, g, beta, scale=None, initial_state=None, chunk_size=64, segment_ids=None,
                gate_lower_bound=None):
    """Chunkwise-parallel KDA (WY/UT form, kda.md §1), same results as ``kda_recurrent``.

    Per chunk of C tokens with chunk-local cumsum G: A = strict-lower beta_r k_r.(k_i e^{G_r-G_i}),
    W = (I+A)^-1 (beta gamma k), U = (I+A)^-1 (beta v) with the explicit unit-lower inverse; a
    ``lax.scan`` over chunks carries S: V_new = U - W S, S' = diag(e^{G_C}) S + kt^T V_new; then
    O = (scale q gamma) S + Aqk V_new for all chunks of a piece at once. Sequences of more than
    ``SEGMENT_CHUNKS`` chunks run as equal pieces in a ``lax.scan`` carrying S (and each piece's
    preceding document id), so the working set stays cache-sized. Any T (internal no-op padding).
    Returns ``(o [B,T,H,V] in v.dtype, final state [B,H,K,V] float32)``.

    ``gate_lower_bound`` (lb < 0): the caller guarantees g >= lb everywhere (the K3 gate
    lb * sigmoid(.) does), which lets the pair products use one matmul per 80/|lb|-token row
    block (``kda_chunk.pair_products``); without it the construction is exact for any g <= 0.

    Measured vs the float64 NumPy loop (``tests/test_kda.py``; T=300, H=2, K=16, V=8, float32):
    C=64 max |do| = 3.2e-7, |dS| = 7.9e-7 with logsigmoid gates, 1.0e-6 / 4.7e-7 with g in
    [-20, 0]; C=16 5.3e-8 / 2.7e-7 (``kda_recurrent``: 7e-8 / 5e-8).
    """
    _check(q, k, v, g, beta, initial_state, segment_ids)
    bounded_block(1, gate_lower_bound)                                 # validates the bound
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    qf, kf, vf, gf, bf, seg, valid = _pad_to_chunks(chunk_size, q, k, v, g, beta, segment_ids)
    s0 = (jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    n = qf.shape[1] // chunk_size
    m = -(-n // SEGMENT_CHUNKS)                                        # pieces
    if m > 1:                                                          # pad to m equal pieces
        extra = (m * -(-n // m) - n) * chunk_size
        z = lambda x: jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        qf, kf, vf, gf, bf = map(z, (qf, kf, vf, gf, bf))              # exact no-op tokens
        seg = None if seg is None else jnp.pad(seg, [(0, 0), (0, extra)], mode="edge")

    def piece(s, xs):
        q_p, k_p, v_p, g_p, b_p, seg_p, prev = xs
        w, u, kt, gl, qh, aqk = _chunk_terms(q_p, k_p, v_p, g_p, b_p, seg_p, chunk_size, scale,
                                             gate_lower_bound, prev)

        def body(s, xs):
            w_c, u_c, kt_c, gl_c = xs
            v_new = u_c - _ein("bhck,bhkv->bhcv", w_c, s)               # [B, H, C, V]
            s_next = gl_c[..., None] * s + _ein("bhck,bhcv->bhkv", kt_c, v_new)
            return s_next, (s, v_new)

        s, (s_in, v_new) = lax.scan(body, s, (w, u, kt, gl))          # s_in [N, B, H, K, V]
        o = _ein("nbhck,nbhkv->nbhcv", qh, s_in) + _ein("nbhci,nbhiv->nbhcv", aqk, v_new)
        return s, jnp.moveaxis(o, (0, 2), (1, 3)).reshape(b, -1, h, dv)  # [B, L, H, V]

    # Differentiated, each of several pieces keeps only its inputs and incoming state for the
    # backward and recomputes its chunk intermediates there, one piece at a time. Saved, those
    # (f32, about 9K + 5V + 4C + KV/C floats per token and head: W, U, the pair products and
    # their inverse, the chunk states...) were the largest temporaries of a K3 train step
    # compiled for TPU (docs/sharding.md section 9). Recomputing them costs a few percent of a
    # KDA layer's FLOPs (the projections dominate).
    if m == 1:  # at most SEGMENT_CHUNKS chunks: their intermediates are small, keep them
        s, o = piece(s0, (qf, kf, vf, gf, bf, seg, None))
    else:  # pieces in sequence, the state carried (cache-sized working set per piece)
        split = lambda x: None if x is None else jnp.moveaxis(  # noqa: E731
            x.reshape(b, m, -1, *x.shape[2:]), 1, 0)                   # [m, B, L, ...]
        segs = split(seg)
        prev = None if seg is None else jnp.concatenate(
            [jnp.zeros_like(segs[:1, :, 0]), segs[:-1, :, -1]])        # [m, B]
        s, o = lax.scan(jax.checkpoint(piece, prevent_cse=False), s0,
                        tuple(map(split, (qf, kf, vf, gf, bf))) + (segs, prev))
        o = jnp.moveaxis(o, 0, 1).reshape(b, -1, h, dv)
    o = o[:, :t]                                                       # [B, T, H, V]
    if valid is not None:
        o = jnp.where(valid[..., None, None], o, 0.0)
    return o.astype(v.dtype), s


def kda_chunk_affine(k, v, g, beta, chunk_size=64, segment_ids=None):
    """The affine map of a sequence piece on the state: ``final = M @ initial + B``.

    k, g [B,T,H,K], v [B,T,H,V], beta [B,T,H] (q is not needed). Returns ``M [B,H,K,K]`` and
    ``B [B,H,K,V]`` (float32). Per chunk the map is S -> (diag(e^{G_C}) - kt^T W) S + kt^T U
    (kda.md §1, tokamax's context-parallel form); chunks compose by ``lax.scan``. A shard of a
    sequence-parallel run computes (M, B) locally, the shards' maps compose left to right
    ((M2, B2) o (M1, B1) = (M2 M1, M2 B1 + B2)), and each shard then reruns ``kda_chunked`` with
    its incoming state. ``segment_ids`` are the piece's own: its first document continues the
    incoming state, so a caller whose piece starts a new document must pass a zero state there.
    """
    _check(k, k, v, g, beta, None, segment_ids)
    b, t, h, dk = k.shape
    _, kf, vf, gf, bf, seg, _ = _pad_to_chunks(chunk_size, k, k, v, g, beta, segment_ids)
    w, u, kt, gl, _, _ = _chunk_terms(kf, kf, vf, gf, bf, seg, chunk_size, 1.0)

    def body(carry, xs):
        m, bb = carry
        w_c, u_c, kt_c, gl_c = xs
        m_c = gl_c[..., :, None] * jnp.eye(dk) - _ein("bhck,bhcj->bhkj", kt_c, w_c)  # [B,H,K,K]
        b_c = _ein("bhck,bhcv->bhkv", kt_c, u_c)
        return (_ein("bhkj,bhji->bhki", m_c, m), _ein("bhkj,bhjv->bhkv", m_c, bb) + b_c), None

    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, h, dk, dk))
    (m, bb), _ = lax.scan(body, (eye, jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)),
                          (w, u, kt, gl))
    return m, bb
