"""KDA maths (``kdsa.model.kda``): chunked vs recurrent vs an independent NumPy float64 loop.

Inputs are unit scale as in the layer: L2-normalised q/k, g = logsigmoid(N(0,1)) (or a strong
lower-bound gate), beta = sigmoid(N(0,1)). Shapes are tiny and few, so the jitted functions below
compile a handful of times only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdsa.model import kda

B, H, K, V = 2, 2, 16, 8
rec = jax.jit(kda.kda_recurrent)
chk = jax.jit(kda.kda_chunked, static_argnames=("chunk_size", "gate_lower_bound"))
step = jax.jit(kda.kda_step)
affine = jax.jit(kda.kda_chunk_affine, static_argnames=("chunk_size",))


def make(t, *, b=B, seed=0, gate="logsigmoid"):
    r = np.random.default_rng(seed)
    q, k = r.standard_normal((2, b, t, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.standard_normal((b, t, H, V))
    if gate == "logsigmoid":
        g = -np.logaddexp(0.0, -r.standard_normal((b, t, H, K)))
    elif gate == "strong":                                  # Kimi-Linear softplus gate tails
        g = -20.0 * r.random((b, t, H, K))
    elif gate == "bounded":                                 # K3 gate: -5 sigmoid(.) in (-5, 0)
        g = -5.0 / (1.0 + np.exp(-2.0 * r.standard_normal((b, t, H, K))))
    else:                                                   # constant strong decay
        g = np.full((b, t, H, K), float(gate))
    beta = 1.0 / (1.0 + np.exp(-r.standard_normal((b, t, H))))
    s0 = r.standard_normal((b, H, K, V))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, s0)]


def numpy_kda(q, k, v, g, beta, s0=None, segment_ids=None):
    """Float64 loop over batch, head and time, straight from the recurrence (kda.md §1)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, h, dk = q.shape
    o = np.zeros(v.shape)
    s_out = np.zeros((b, h, dk, v.shape[-1]))
    ids = np.ones((b, t), int) if segment_ids is None else np.asarray(segment_ids)
    for bi in range(b):
        for hi in range(h):
            s = np.zeros((dk, v.shape[-1])) if s0 is None else np.asarray(s0, np.float64)[bi, hi]
            last = 0
            for ti in range(t):
                sid = ids[bi, ti]
                if sid == 0:                                # padding: no-op, output 0
                    continue
                if last != 0 and sid != last:               # a new document: state restarts
                    s = np.zeros_like(s)
                last = sid
                s = np.exp(g[bi, ti, hi])[:, None] * s
                kk = k[bi, ti, hi]
                s = s + beta[bi, ti, hi] * np.outer(kk, v[bi, ti, hi] - s.T @ kk)
                o[bi, ti, hi] = s.T @ (dk ** -0.5 * q[bi, ti, hi])
            s_out[bi, hi] = s
    return o, s_out


def err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ---- forward agreement ------------------------------------------------------------------------

def test_recurrent_matches_numpy_float64():
    q, k, v, g, beta, s0 = make(65, seed=1)
    o, s = rec(q, k, v, g, beta, initial_state=s0)
    o_ref, s_ref = numpy_kda(q, k, v, g, beta, s0)
    assert err(o, o_ref) < 1e-5 and err(s, s_ref) < 1e-5


# (T, chunk sizes with an initial state, chunk size without): every T against every chunk size
# would compile 20 programs; this covering set keeps each T and C, both padded and exact.
GRID = {1: ((16,), 64), 63: ((32,), 64), 64: ((16,), 64), 65: ((64,), 32), 300: ((16, 32, 64), 16)}


@pytest.mark.parametrize("t", sorted(GRID))
def test_chunked_matches_recurrent(t):
    q, k, v, g, beta, s0 = make(t, seed=t)
    with_state, without_state = GRID[t]
    o_r, s_r = rec(q, k, v, g, beta, initial_state=s0)
    for c in with_state:
        o_c, s_c = chk(q, k, v, g, beta, initial_state=s0, chunk_size=c)
        assert err(o_c, o_r) <= 1e-5 and err(s_c, s_r) <= 1e-5, (t, c)
    o_r, s_r = rec(q, k, v, g, beta)
    o_c, s_c = chk(q, k, v, g, beta, chunk_size=without_state)
    assert err(o_c, o_r) <= 1e-5 and err(s_c, s_r) <= 1e-5


def test_chunked_matches_numpy_float64_strong_gates():
    q, k, v, g, beta, s0 = make(300, seed=3, gate="strong")
    o_c, s_c = chk(q, k, v, g, beta, initial_state=s0, chunk_size=64)
    o_ref, s_ref = numpy_kda(q, k, v, g, beta, s0)
    assert err(o_c, o_ref) <= 1e-5 and err(s_c, s_ref) <= 1e-5


def test_bounded_gate_path_matches_numpy_float64():
    """``gate_lower_bound=-5`` (midpoint-factored 16-token row blocks) on the K3 gate."""
    q, k, v, g, beta, s0 = make(300, seed=15, gate="bounded")
    o_c, s_c = chk(q, k, v, g, beta, initial_state=s0, chunk_size=64, gate_lower_bound=-5.0)
    o_ref, s_ref = numpy_kda(q, k, v, g, beta, s0)
    assert err(o_c, o_ref) <= 1e-5 and err(s_c, s_ref) <= 1e-5


def test_step_is_one_recurrent_token():
    q, k, v, g, beta, s0 = make(5, seed=4)
    o_r, s_r = rec(q, k, v, g, beta, initial_state=s0)
    s = s0
    for t in range(5):
        o, s = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(o_r[:, t]))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_r))


def test_bfloat16_inputs():
    """bf16 in, bf16 out; internal float32, so the only extra error is the final rounding.

    Measured: max |o_bf16 - o_f32(same rounded inputs)| = 7.4e-4 for |o| <= 0.3 (bf16 half-ulp)."""
    q, k, v, g, beta, s0 = make(65, seed=5)
    xs = [x.astype(jnp.bfloat16) for x in (q, k, v, g, beta)]
    o16, s16 = chk(*xs, initial_state=s0, chunk_size=64)
    o32, s32 = chk(*[x.astype(jnp.float32) for x in xs], initial_state=s0, chunk_size=64)
    assert o16.dtype == jnp.bfloat16 and s16.dtype == jnp.float32
    assert err(o16, o32) <= 2 ** -8 * float(jnp.max(jnp.abs(o32))) + 1e-6
    assert err(s16, s32) <= 1e-5


# ---- gradients --------------------------------------------------------------------------------

def _loss(fn, q, k, v, g, beta, s0, wo, ws):
    o, s = fn(q, k, v, g, beta, initial_state=s0)
    return jnp.sum(o * wo) + jnp.sum(s * ws)


_grad_rec = jax.jit(jax.grad(lambda *a: _loss(kda.kda_recurrent, *a), argnums=range(6)))
_grad_chk = jax.jit(jax.grad(
    lambda *a: _loss(lambda *x, **kw: kda.kda_chunked(*x, chunk_size=32, **kw), *a),
    argnums=range(6)))
_grad_chk_bounded = jax.jit(jax.grad(
    lambda *a: _loss(lambda *x, **kw: kda.kda_chunked(*x, chunk_size=32, gate_lower_bound=-5.0,
                                                      **kw), *a),
    argnums=range(6)))


@pytest.mark.parametrize("gate", ["logsigmoid", -5.0])
def test_gradients_agree(gate):
    """Both forms' gradients for q, k, v, g, beta and the initial state; g = -5 constant over 256
    tokens is the strong-decay case whose naive chunked gradients are NaN (kda.md §3). At the
    bound itself the bounded-gate path (``gate_lower_bound=-5``) is checked too."""
    q, k, v, g, beta, s0 = make(256, b=1, seed=6, gate=gate)
    r = np.random.default_rng(7)
    wo, ws = (jnp.asarray(r.standard_normal(x.shape), jnp.float32) for x in (v, s0))
    g_r = _grad_rec(q, k, v, g, beta, s0, wo, ws)
    chunked = [_grad_chk] + ([_grad_chk_bounded] if gate == -5.0 else [])
    for grad_fn in chunked:
        g_c = grad_fn(q, k, v, g, beta, s0, wo, ws)
        for name, a, c in zip("q k v g beta s0".split(), g_r, g_c):
            assert bool(jnp.all(jnp.isfinite(c))), name
            assert err(a, c) <= 1e-4 * max(1.0, float(jnp.max(jnp.abs(a)))), name


# ---- state passing: split, affine map ---------------------------------------------------------

def test_split_in_two_equals_whole():
    q, k, v, g, beta, s0 = make(128, seed=8)
    o, s = numpy_kda(q, k, v, g, beta, s0)                  # the whole sequence
    o1, s1 = chk(*(x[:, :64] for x in (q, k, v, g, beta)), initial_state=s0, chunk_size=16)
    o2, s2 = chk(*(x[:, 64:] for x in (q, k, v, g, beta)), initial_state=s1, chunk_size=16)
    assert err(jnp.concatenate([o1, o2], axis=1), o) <= 1e-5 and err(s2, s) <= 1e-5


def test_affine_map_reproduces_final_state():
    q, k, v, g, beta, s0 = make(65, seed=9)
    m, bb = affine(k, v, g, beta, chunk_size=32)
    _, s = chk(q, k, v, g, beta, initial_state=s0, chunk_size=64)
    assert err(jnp.einsum("bhkj,bhjv->bhkv", m, s0) + bb, s) <= 1e-5
    ids = jnp.asarray([[1] * 40 + [2] * 20 + [0] * 5, [4] * 65], jnp.int32)  # row 0 resets
    m, bb = affine(k, v, g, beta, chunk_size=32, segment_ids=ids)
    _, s = numpy_kda(q, k, v, g, beta, s0, ids)
    assert err(jnp.einsum("bhkj,bhjv->bhkv", m, s0) + bb, s) <= 1e-5
    assert float(jnp.max(jnp.abs(m[0]))) == 0.0 and float(jnp.max(jnp.abs(m[1]))) > 0.0


# ---- packed documents and padding -------------------------------------------------------------

def _ids():
    ids = np.zeros((B, 100), np.int32)
    ids[0, :30], ids[0, 45:70], ids[0, 70:95] = 1, 1, 2     # doc 1 resumes after a pad run
    ids[1, 3:50], ids[1, 50:51], ids[1, 51:] = 3, 5, 7      # leading pads, a 1-token doc
    return ids


def test_segments_equal_separate_runs_and_numpy():
    q, k, v, g, beta, s0 = make(100, seed=10)
    ids = _ids()
    outs = [rec(q, k, v, g, beta, initial_state=s0, segment_ids=jnp.asarray(ids)),
            chk(q, k, v, g, beta, initial_state=s0, chunk_size=16, segment_ids=jnp.asarray(ids))]
    # checked in NumPy: gathers and reductions on jax arrays are an eager compile per shape
    outs = [(np.asarray(o), np.asarray(s)) for o, s in outs]
    o_ref, s_ref = numpy_kda(q, k, v, g, beta, s0, ids)
    for o, s in outs:
        assert err(o, o_ref) <= 1e-5 and err(s, s_ref) <= 1e-5
        assert float(np.max(np.abs(o[0, 30:45]))) == 0.0  # padding outputs 0
    # each document alone (first one from s0, later ones from zero) equals the packed run
    q, k, v, g, beta, s0 = (np.asarray(x) for x in (q, k, v, g, beta, s0))  # NumPy slicing
    docs = [(0, np.r_[0:30, 45:70], s0[:1]), (0, np.r_[70:95], None),
            (1, np.r_[3:50], s0[1:]), (1, np.r_[50:51], None), (1, np.r_[51:100], None)]
    for row, idx, init in docs:
        o1, s1 = numpy_kda(*(x[row:row + 1, idx] for x in (q, k, v, g, beta)), init)
        for o, _ in outs:
            assert err(o[row, idx], o1[0]) <= 1e-5
    for _, s in outs:                                       # row 1 ends in its last document
        assert err(s[1], s1[0]) <= 1e-5


def test_padding_is_a_no_op():
    q, k, v, g, beta, s0 = make(64, seed=11)
    o, s = chk(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    pos = np.sort(np.random.default_rng(12).choice(100, 64, replace=False))  # real positions
    ids = np.zeros((B, 100), np.int32)
    ids[:, pos] = 1
    pad = lambda x: jnp.zeros((B, 100) + x.shape[2:], x.dtype).at[:, pos].set(x)  # noqa: E731
    junk = np.random.default_rng(13).standard_normal((B, 100, H, K))    # garbage where padded
    gp = pad(g) + jnp.asarray(np.where(ids[..., None, None] == 0, junk, 0), jnp.float32)
    for fn in (lambda *a, **kw: chk(*a, chunk_size=16, **kw), rec):
        op, sp = fn(pad(q), pad(k), pad(v), gp, pad(beta) + 0.5 * (ids == 0)[..., None],
                    initial_state=s0, segment_ids=jnp.asarray(ids))
        assert err(op[:, pos], o) <= 1e-5 and err(sp, s) <= 1e-5
        assert float(jnp.max(jnp.abs(op[:, ids[0] == 0]))) == 0.0


# ---- bad input --------------------------------------------------------------------------------

def test_bad_shapes_raise():
    q, k, v, g, beta, s0 = make(8, seed=14)
    with pytest.raises(ValueError, match="k must have q's shape"):
        kda.kda_chunked(q, k[..., :4], v, g, beta)
    with pytest.raises(ValueError, match="beta must have shape"):
        kda.kda_recurrent(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="state must be"):
        kda.kda_chunked(q, k, v, g, beta, initial_state=s0[:, :1])
    with pytest.raises(ValueError, match="segment_ids"):
        kda.kda_chunked(q, k, v, g, beta, segment_ids=jnp.ones((B, 8)))
    with pytest.raises(ValueError, match="chunk_size"):
        kda.kda_chunked(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match="gate_lower_bound"):
        kda.kda_chunked(q, k, v, g, beta, gate_lower_bound=0.0)
    with pytest.raises(ValueError, match="q must be"):
        kda.kda_step(q, k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)


def test_pieces_carry_state_and_documents():
    """More than ``SEGMENT_CHUNKS`` chunks run as pieces in a scan (state and the preceding
    document carried): packed documents crossing piece boundaries, leading padding and an
    initial state equal the float64 loop; gradients of a 4-piece run equal the recurrent ones."""
    assert kda.SEGMENT_CHUNKS == 8
    q, k, v, g, beta, s0 = make(100, seed=10)
    ids = _ids()                                            # C=4: 25 chunks -> 4 pieces of 7
    o, s = chk(q, k, v, g, beta, initial_state=s0, chunk_size=4, segment_ids=jnp.asarray(ids))
    o_ref, s_ref = numpy_kda(q, k, v, g, beta, s0, ids)
    assert err(o, o_ref) <= 1e-5 and err(s, s_ref) <= 1e-5
    q, k, v, g, beta, s0 = make(256, b=1, seed=6, gate="logsigmoid")
    r = np.random.default_rng(7)
    wo, ws = (jnp.asarray(r.standard_normal(x.shape), jnp.float32) for x in (v, s0))
    pieces = jax.jit(jax.grad(lambda *a: _loss(                # C=8: 32 chunks -> 4 pieces
        lambda *x, **kw: kda.kda_chunked(*x, chunk_size=8, **kw), *a), argnums=range(6)))
    for name, a, c in zip("q k v g beta s0".split(), _grad_rec(q, k, v, g, beta, s0, wo, ws),
                          pieces(q, k, v, g, beta, s0, wo, ws)):
        assert err(a, c) <= 1e-4 * max(1.0, float(jnp.max(jnp.abs(a)))), name


def test_chunked_backward_recomputes_piece_intermediates():
    """The gradient of ``kda_chunked`` keeps each piece's inputs and incoming state, not its
    float32 chunk intermediates (W, U, pair products, chunk states: about 9K + 5V + 4C + KV/C
    floats per token and head), which it recomputes piece by piece. Measured at T 4096, H 4,
    K = V = C = 64 on CPU: XLA's temporaries 31.7 MB with the piece checkpoint, 239 MB
    without, the intermediates 79.7 MB (docs/sharding.md section 9: 78.5 -> 50.4 GiB for a K3
    slice's TPU train step at 8K tokens)."""
    b, t, h, dk, dv, c = 1, 4096, 4, 64, 64, 64
    ks = jax.random.split(jax.random.key(0), 5)
    q, k = jax.random.normal(ks[0], (b, t, h, dk)), 0.1 * jax.random.normal(ks[1], (b, t, h, dk))
    v = jax.random.normal(ks[2], (b, t, h, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h, dk)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))

    def loss(*x):
        return jnp.sum(kda.kda_chunked(*x, chunk_size=c)[0] ** 2)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(q, k, v, g, beta).compile()
    intermediates = (9 * dk + 5 * dv + 4 * c + dk * dv / c) * 4 * b * t * h
    assert compiled.memory_analysis().temp_size_in_bytes < intermediates  # 0.4x; 3x saved


def test_row_block_for_very_negative_gate_bounds():
    """A gate bound below -80 leaves no row block whose exponents stay bounded: the strips
    (None), not a ZeroDivisionError (``bounded_block`` divided by a zero block size)."""
    from kdsa.model.kda_chunk import bounded_block

    assert bounded_block(64, -5.0) == 16 and bounded_block(64, -30.0) is None
    assert bounded_block(64, -100.0) is None and bounded_block(1, -81.0) is None
