"""Intra-chunk pieces of the chunkwise KDA form: local cumsum, decayed pair products, UT inverse.

Pure functions on chunk-major float32 tensors ``[..., C, K]`` (one chunk of C tokens per leading
index), used by ``kdsa.model.kda.kda_chunked``. Maths in ``docs/reference/kda.md`` §1.

The pair products ``P_x[r, i] = sum_d x[r,d] k[i,d] exp(cg[r,d] - cg[i,d])`` (i <= r) cannot be
one matmul for a general gate: a shared reference gate splits the decay into two factors whose
exponents can overflow (kda.md §5 pitfall 1). Three exact constructions, chosen by
``pair_products``:

* ``_halving`` (any gate, any C): neighbouring blocks merged level by level with the decay
  factored at the left block's last token, every exponent <= 0; log2(C) levels of small matmuls.
* ``_strips`` (any gate, C a multiple of 16): rows of 16-token block R against all columns
  before R in one matmul, factored at the token just before R (cg does not increase, so both
  exponents are <= 0 for every such pair); the 16 x 16 diagonal blocks by ``_halving``.
* ``_bounded`` (gate known to satisfy g >= lb): the row block's midpoint as reference, both
  factors within exp(+-b|lb|/2) <= exp(40) (fla's / tokamax's ``safe_gate`` idea, Kimi Linear
  kernels), so each row block is one matmul against every column up to its end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST
_STRIP = 16          # row-block size of the strip construction
_MAX_EXPONENT = 40.0  # bound on |exponent| of one factor in the bounded construction


def _ein(eq: str, *xs: jax.Array) -> jax.Array:
    return jnp.einsum(eq, *xs, precision=_HI, preferred_element_type=jnp.float32)


def chunk_cumsum(g: jax.Array) -> jax.Array:
    """Inclusive cumsum over the chunk axis of ``g [..., C, K]`` as a lower-triangular matmul.

    Chunk-local only (never across chunks). One batched matmul, cheaper on XLA:CPU than
    ``jnp.cumsum``'s associative-scan lowering (which slices and pads log2(C) times); the sum
    order differs from a running sum by float32 rounding only.
    """
    c = g.shape[-2]
    return _ein("ij,...jk->...ik", jnp.tril(jnp.ones((c, c), jnp.float32)), g)


# ----------------------------------------------------------------------------------------------
# Pair products
# ----------------------------------------------------------------------------------------------

def bounded_block(c_len: int, gate_lower_bound: float | None) -> int | None:
    """Row-block size b of the bounded construction for chunk C and gate bound lb, or None.

    b is the largest divisor of C with b |lb| / 2 <= 40 (a factor <= exp(40), a product of the
    two <= exp(80) < float32 max even above the diagonal, where it is masked after); None when
    there is no bound or b would be below 8 (lb < -10: the strip construction is then cheaper).
    """
    if gate_lower_bound is None:
        return None
    lb = float(gate_lower_bound)
    if not lb < 0.0:
        raise ValueError(f"gate_lower_bound must be negative, got {gate_lower_bound!r}")
    b = min(c_len, int(2 * _MAX_EXPONENT / -lb))
    if b < 8:  # (a bound below -2 * _MAX_EXPONENT gave b = 0: a ZeroDivisionError below)
        return None
    while c_len % b:
        b -= 1
    return b if b >= 8 else None


def pair_products(x, k, cg, gate_lower_bound=None):
    """``P[..., j, r, i] = sum_d x[..., j, r, d] k[..., i, d] exp(cg[r, d] - cg[i, d])`` for i <= r.

    x [..., X, C, K] (the stacked row operands, e.g. scale*q and k); k, cg [..., C, K] with cg the
    chunk-local inclusive cumsum of g <= 0. Returns [..., X, C, C], exact zeros above the
    diagonal. ``gate_lower_bound`` (lb, every g >= lb) selects the bounded construction; a gate
    below lb breaks its no-overflow guarantee, so pass it only when the activation ensures it.
    """
    c_len = cg.shape[-2]
    b = bounded_block(c_len, gate_lower_bound)
    if b is not None:
        return _bounded(x, k, cg, b)
    if c_len % _STRIP == 0 and c_len > _STRIP:
        return _strips(x, k, cg, _STRIP)
    return _halving(x, k, cg)


def _halving(x, k, cg):
    """Built from the diagonal up: base blocks of C's odd factor s0 (1 for C = 2^m) with their
    pairwise decay masked before exp; then at block size s every pair of neighbouring blocks
    (L, R) adds R's rows against L's columns with the decay factored at L's last token e_L,
    exp(cg_r - e_L) * exp(e_L - cg_i), both exponents <= 0, one batched ``[X s, K] x [K, s]``
    matmul per level. x [..., X, C, K]; k, cg [..., C, K] -> [..., X, C, C]."""
    *lead, c_len, dk = cg.shape
    nx = x.shape[-3]
    s = c_len // (c_len & -c_len)                                      # odd base block
    blk = lambda y: y.reshape(*y.shape[:-2], c_len // s, s, dk)  # noqa: E731  [.., C/s, s, K]
    cgb = blk(cg)
    diff = cgb[..., :, None, :] - cgb[..., None, :, :]                 # [..., C/s, s, s, K]
    tril = jnp.tril(jnp.ones((s, s), bool))[..., None]
    kd = blk(k)[..., None, :, :] * jnp.exp(jnp.where(tril, diff, -jnp.inf))  # mask, then exp
    p = jnp.sum(blk(x)[..., :, None, :] * kd[..., None, :, :, :, :], axis=-1)  # [.,X,C/s,s,s]
    while s < c_len:                                                   # blocks s -> 2s
        nb = c_len // (2 * s)
        xb = x.reshape(*lead, nx, nb, 2, s, dk)
        kb = k.reshape(*lead, nb, 2, s, dk)
        cgb = cg.reshape(*lead, nb, 2, s, dk)
        e = cgb[..., 0, -1:, :]                                        # e_L [..., nb, 1, K]
        xr = xb[..., 1, :, :] * jnp.exp(cgb[..., 1, :, :] - e)[..., None, :, :, :]
        kl = kb[..., 0, :, :] * jnp.exp(e - cgb[..., 0, :, :])         # [..., nb, s, K]
        off = _ein("...xnrd,...nid->...xnri", xr, kl)                  # [..., X, nb, s, s]
        pb = p.reshape(*lead, nx, nb, 2, s, s)
        top = jnp.concatenate([pb[..., 0, :, :], jnp.zeros_like(off)], axis=-1)
        bottom = jnp.concatenate([off, pb[..., 1, :, :]], axis=-1)
        p = jnp.concatenate([top, bottom], axis=-2)                    # [..., X, nb, 2s, 2s]
        s *= 2
    return p.reshape(*lead, nx, c_len, c_len)


def _assemble(rows, b, c_len):
    """Row blocks ``[..., X, b, w_R]`` (w_R <= C, left-aligned) -> ``[..., X, C, C]``."""
    pad = lambda r: jnp.pad(r, [(0, 0)] * (r.ndim - 1) + [(0, c_len - r.shape[-1])])  # noqa: E731
    return jnp.concatenate([pad(r) if r.shape[-1] < c_len else r for r in rows], axis=-2)


def _strips(x, k, cg, b):
    """Row block R (tokens [Rb, Rb + b)) against columns i < Rb in one matmul, factored at
    e = cg[Rb - 1]: exp(cg_r - e) <= 1 and exp(e - cg_i) <= 1 for every such pair; the b x b
    diagonal blocks by ``_halving``. Against ``_halving`` over the whole chunk: 2 levels of
    b-wide matmuls instead of log2(C/b) levels of ever smaller ones."""
    *lead, c_len, dk = cg.shape
    nb = c_len // b
    blk = lambda y: y.reshape(*y.shape[:-2], nb, b, dk)  # noqa: E731
    xd = jnp.moveaxis(blk(x), -4, -3)                                  # [..., nb, X, b, K]
    diag = jnp.moveaxis(_halving(xd, blk(k), blk(cg)), -3, -4)         # [..., X, nb, b, b]
    rows = [diag[..., 0, :, :]]
    for r in range(1, nb):
        lo, hi = r * b, (r + 1) * b
        e = cg[..., lo - 1:lo, :]                                      # [..., 1, K]
        xr = x[..., lo:hi, :] * jnp.exp(cg[..., lo:hi, :] - e)[..., None, :, :]  # [..,X,b,K]
        kl = k[..., :lo, :] * jnp.exp(e - cg[..., :lo, :])             # [..., Rb, K]
        rows.append(jnp.concatenate([_ein("...xrd,...id->...xri", xr, kl),
                                     diag[..., r, :, :]], axis=-1))     # [..., X, b, Rb + b]
    return _assemble(rows, b, c_len)


def _bounded(x, k, cg, b):
    """Row block R against columns i < (R+1) b in one matmul, factored at the block's midpoint
    m: |cg_r - cg_m| <= b|lb|/2 and cg_m - cg_i <= b|lb|/2 for those columns (kda.md §1, fla
    ``safe_gate``). The diagonal block's upper triangle holds finite values up to exp(b|lb|)
    and is zeroed by a product afterwards (finite times 0: no NaN in the gradients)."""
    c_len = cg.shape[-2]
    tril = jnp.tril(jnp.ones((b, b), jnp.float32))
    rows = []
    for r in range(c_len // b):
        lo, hi = r * b, (r + 1) * b
        m = cg[..., lo + b // 2:lo + b // 2 + 1, :]                    # [..., 1, K]
        xr = x[..., lo:hi, :] * jnp.exp(cg[..., lo:hi, :] - m)[..., None, :, :]  # [..,X,b,K]
        kl = k[..., :hi, :] * jnp.exp(m - cg[..., :hi, :])             # [..., hi, K]
        p = _ein("...xrd,...id->...xri", xr, kl)                       # [..., X, b, hi]
        rows.append(jnp.concatenate([p[..., :lo], p[..., lo:] * tril], axis=-1) if lo
                    else p * tril)
    return _assemble(rows, b, c_len)


# ----------------------------------------------------------------------------------------------
# UT transform inverse
# ----------------------------------------------------------------------------------------------

def _block_size(c_len: int) -> int:
    """Largest divisor of C reached by halving while above 8 (8 for C = 16, 32, 64, ...)."""
    b = c_len
    while b % 2 == 0 and b > 8:
        b //= 2
    return b


def unit_lower_inverse(a):
    """``(I + a)^-1`` for strictly lower-triangular ``a [..., C, C]``, by matmuls only.

    Diagonal blocks of b <= 8 use the finite Neumann series of the nilpotent block,
    (I - L)(I + L^2)(I + L^4) = sum_{j<8} (-L)^j; blocks then merge pairwise as
    [[T11, 0], [-T22 a21 T11, T22]] (fla builds (I+A)^-1 from block solves the same way).
    Replaces ``lax.linalg.triangular_solve``, whose batched CPU lowering measured 20 ms to 1 s
    for the same work (16-64 chunks x 4 heads of 64 x 64, erratic by batch size); the row loop
    alternative needs a custom VJP to avoid saving every row update. Relative error vs float64
    ``inv``: 2e-7 for random blocks, 1.3e-6 for the ill-conditioned A = 0.99 * strict-lower ones
    (C=64; ``triangular_solve``: 1e-8).
    """
    *lead, c_len, _ = a.shape
    b = _block_size(c_len)
    n = c_len // b
    blocks = lambda s, i, j: a[..., i * s:(i + 1) * s, j * s:(j + 1) * s]  # noqa: E731
    lo = jnp.stack([blocks(b, i, i) for i in range(n)], axis=-3)           # [..., n, b, b]
    eye = jnp.eye(b, dtype=jnp.float32)
    t, p, m = eye - lo, lo, 1
    while 2 * m < b:                                                       # Neumann product
        p = _ein("...ij,...jk->...ik", p, p)
        t = _ein("...ij,...jk->...ik", t, eye + p)
        m *= 2
    s = b
    while s < c_len:                                                       # pairwise merges
        big = c_len // (2 * s)
        a21 = jnp.stack([blocks(s, 2 * i + 1, 2 * i) for i in range(big)], axis=-3)
        t2 = t.reshape(*lead, big, 2, s, s)
        t11, t22 = t2[..., 0, :, :], t2[..., 1, :, :]
        x21 = -_ein("...ij,...jl->...il", t22, _ein("...jk,...kl->...jl", a21, t11))
        top = jnp.concatenate([t11, jnp.zeros_like(t11)], axis=-1)
        t = jnp.concatenate([top, jnp.concatenate([x21, t22], axis=-1)], axis=-2)
        s *= 2
    return t.reshape(*lead, c_len, c_len)
