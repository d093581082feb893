"""Sparse MLA attention: Pallas kernel (interpret mode on CPU) vs the XLA references.

References: ``kdsa.model.dsa.sparse_mla_attention`` (gather, autodiff gradients) and
``dense_masked_mla_attention`` (full scores + log multiplicity mask, DeepSeek's formulation).
Inputs hold every edge case at once: -1 slots, indices >= S, duplicated indices, a query with
no valid index, K larger than the keys some queries can see. Measured (f32, main case): max abs
error out 7.2e-7, lse 9.5e-7, dq 1.7e-6, dlatent 2.2e-6, drope 1.4e-6 (gradients up to 4.8);
decode case out and lse bit-equal, gradients 3.2e-6 (up to 6.7).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdsa.kernels_pallas import sparse_mla_attention
from kdsa.kernels_pallas.sparse_mla import (dense_masked_mla_attention, kernel,
                                            sparse_mla_attention_ref)
from kdsa.model.config import get_preset
from kdsa.model.dsa_layer import GatedDSA, init_dsa_cache

B, T, N, S, DC, DR, K = 2, 13, 4, 50, 32, 8, 16
SCALE = 0.3
TOL = dict(atol=5e-6, rtol=1e-5)


def run_jit(fn, *args):
    """``jax.jit(fn)(*args)`` compiled at XLA backend optimisation level 0: these are
    correctness checks, and the interpret-mode kernels compile about twice as fast."""
    compiled = jax.jit(fn).trace(*args).lower().compile(
        compiler_options={"xla_backend_optimization_level": 0})
    return compiled(*args)


def make_problem(seed, b=B, t=T, n=N, s=S, dims=(DC, DR), k=K):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, n, sum(dims))), jnp.float32)
    kv = tuple(jnp.asarray(rng.normal(size=(b, s, d)), jnp.float32) for d in dims)
    idx = rng.integers(-1, s, (b, t, k))
    if t > 5 and b > 1:
        idx[0, 3, :] = -1                   # no valid index: out 0, lse -inf, zero gradients
        idx[1, 2, 5:8] = idx[1, 2, 4]       # a key selected four times
        idx[1, 4, :3] = [s, s + 7, -5]      # out of range counts as unused
        idx[0, 5, 1:] = -1                  # a single valid slot
    return q, kv, jnp.asarray(idx, jnp.int32)


def loss_fn(attend, idx, v_dim, w_out, w_lse, **kw):
    """Scalar mixing out and (finite) lse, so both cotangents are exercised."""
    def loss(q, *kv):
        out, lse = attend(q, kv if len(kv) > 1 else kv[0], idx, SCALE, v_dim, **kw)
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out * w_out) + jnp.sum(finite * w_lse), (out, lse)
    return loss


def run_both(q, kv, idx, v_dim, extra=None, **kw):
    """(out, lse, grads) of the kernel (``**kw``) and of the reference; with ``extra = (kv2,
    v_dim2)`` also the forward output for that second key form, in the same jit."""
    rng = np.random.default_rng(99)
    w_out = jnp.asarray(rng.normal(size=(*q.shape[:3], v_dim)), jnp.float32)
    w_lse = jnp.asarray(rng.normal(size=q.shape[:3]), jnp.float32)
    argnums = tuple(range(1 + len(kv)))
    res = []
    for attend, options in ((sparse_mla_attention, kw), (sparse_mla_attention_ref, {})):
        f = jax.value_and_grad(loss_fn(attend, idx, v_dim, w_out, w_lse, **options),
                               argnums=argnums, has_aux=True)

        def both(q, *kv, attend=attend, f=f):
            (_, (out, lse)), grads = f(q, *kv)
            second = None if extra is None else attend(q, extra[0], idx, SCALE, extra[1])[0]
            return out, lse, grads, second

        res.append(run_jit(both, q, *kv))
    return res


@pytest.fixture(scope="module")
def main_case():
    """Latent + RoPE key parts; 2 slot tiles of 8, 2 head blocks of 2, backward in 4 query
    chunks (the defaults, one tile and one block, run in the decode and layer tests)."""
    q, kv, idx = make_problem(0)
    return (q, kv, idx), run_both(q, kv, idx, DC, block_k=8, block_h=2, chunk_size=4)


def assert_lse_close(lse, want):
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want))
    np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse), np.where(np.isinf(want), 0, want),
                               **TOL)


def test_forward_matches_both_references(main_case):
    (q, kv, idx), ((out, lse, _, _), (rout, rlse, _, _)) = main_case
    dout, dlse = run_jit(lambda q, kv, i: dense_masked_mla_attention(q, kv, i, SCALE, DC),
                         q, jnp.concatenate(kv, -1), idx)
    for want_out, want_lse in ((rout, rlse), (dout, dlse)):
        np.testing.assert_allclose(out, want_out, **TOL)
        assert_lse_close(lse, want_lse)
    assert out.shape == (B, T, N, DC) and lse.shape == (B, T, N) and out.dtype == jnp.float32
    assert np.all(np.asarray(out[0, 3]) == 0) and np.all(np.isneginf(np.asarray(lse[0, 3])))


def test_gradients_match_reference_autodiff(main_case):
    (q, kv, idx), ((_, _, grads, _), (_, _, rgrads, _)) = main_case
    for name, g, r in zip(("dq", "dlatent", "drope"), grads, rgrads):
        assert np.all(np.isfinite(g)), name
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5, err_msg=name)
    assert np.all(np.asarray(grads[0][0, 3]) == 0)          # the all-invalid query: dq = 0
    # a key no valid slot selects gets exactly zero gradient
    used = np.zeros((B, S), bool)
    ii = np.asarray(idx)
    for b in range(B):
        used[b, ii[b][(ii[b] >= 0) & (ii[b] < S)]] = True
    assert np.all(np.asarray(grads[1])[~used] == 0) and (~used).any()


def test_decode_shape_one_key_array():
    """Decode (T = 1, 32 heads, K = 16 > S = 9 keys), default tiles; kv one array: values =
    the whole key (one part, forward and gradient) and values = its first 16 of 24 columns
    (split once in the wrapper, forward)."""
    q, kv, idx = make_problem(2, b=2, t=1, n=32, s=9, dims=(24,), k=16)
    idx = idx.at[0, 0].set(-1).at[1, 0, 3:6].set(idx[1, 0, 2])  # no valid slot; duplicates
    (out, lse, grads, out16), (rout, rlse, rgrads, rout16) = run_both(
        q, kv, idx, 24, extra=(kv[0], 16))
    np.testing.assert_allclose(out, rout, **TOL)
    assert_lse_close(lse, rlse)
    np.testing.assert_allclose(out16, rout16, **TOL)
    for g, r in zip(grads, rgrads):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)


def test_plan_pads_to_triton_tiles():
    p = kernel.plan(s=100, h=4, k=13, v_dim=512, d_b=64)
    assert (p.hp, p.bh, p.kp, p.bk, p.da, p.db) == (16, 16, 16, 16, 512, 64)
    p = kernel.plan(s=100, h=128, k=2048, v_dim=24, d_b=8)
    assert (p.hp, p.bh, p.kp, p.bk, p.da, p.db) == (128, 64, 2048, 64, 32, 16)
    with pytest.raises(ValueError, match="block_k"):
        kernel.plan(s=1, h=1, k=1, v_dim=1, d_b=0, block_k=24)


def test_bad_inputs_name_the_problem():
    q, kv, idx = make_problem(3, t=2, s=5, k=3)
    with pytest.raises(ValueError, match="kv must be"):
        sparse_mla_attention(q, kv[0], idx, SCALE, DC)
    with pytest.raises(ValueError, match="indices must be"):
        sparse_mla_attention(q, kv, idx[:, :1], SCALE, DC)
    with pytest.raises(ValueError, match="indices must be"):
        sparse_mla_attention(q, kv, idx.astype(jnp.float32), SCALE, DC)
    with pytest.raises(ValueError, match="v_dim"):
        sparse_mla_attention(q, kv, idx, SCALE, DC + DR + 1)
    with pytest.raises(ValueError, match="q must be"):
        sparse_mla_attention(q[0], kv, idx, SCALE, DC)
    with pytest.raises(ValueError, match="impl"):
        sparse_mla_attention(q, kv, idx, SCALE, DC, impl="cuda")
    out = jax.eval_shape(lambda: sparse_mla_attention(q, kv, idx, SCALE, DC, impl="xla"))
    assert out[0].shape == (B, 2, N, DC)                    # the reference, not traced further


def test_lowers_for_gpu_triton():
    """Forward and backward go through the Pallas -> Triton lowering for CUDA (K3 widths:
    latent 512, RoPE key 64, 128 heads, top-2048), bf16; not the Triton compiler itself."""
    from jax._src import mesh as mesh_lib
    shapes = [jax.ShapeDtypeStruct(sh, jnp.bfloat16)
              for sh in ((1, 1, 128, 576), (1, 300, 512), (1, 300, 64))]
    idx = jax.ShapeDtypeStruct((1, 1, 2048), jnp.int32)

    def grad(q, lat, rope, i):
        f = lambda *a: jnp.sum(sparse_mla_attention(a[0], a[1:], i, 0.1, 512,  # noqa: E731
                                                    interpret=False)[0])
        return jax.grad(f, argnums=(0, 1, 2))(q, lat, rope)

    device = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(
            jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        warnings.simplefilter("ignore")                  # Pallas Triton deprecation notice
        exported = jax.export.export(
            jax.jit(grad), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
                "__gpu$xla.gpu.triton")])(*shapes, idx)
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") >= 2   # forward + backward


def random_params(abstract):
    """Gaussian weights ``fan_in**-0.5`` (matrices), ``1 + 0.1 N(0, 1)`` (norm scales)."""
    rng = np.random.default_rng(5)

    def draw(a):
        if len(a.shape) == 1:
            return jnp.asarray(1.0 + 0.1 * rng.normal(size=a.shape), a.dtype)
        return jnp.asarray(rng.normal(size=a.shape) * a.shape[0] ** -0.5, a.dtype)
    return jax.tree.map(draw, abstract)


def test_gated_dsa_layer_pallas_matches_xla():
    """The ``tiny`` preset's Gated DSA layer (4 heads, latent 32 + RoPE key 8, top-4 of 10
    tokens) with ``attention_impl="pallas"`` vs ``"xla"``: training forward and every parameter
    gradient equal; the kernel (forward and backward) is in the pallas program and in its cache
    (prefill / decode) path. The whole tiny Transformer is not used: its gradient takes ~80 CPU
    seconds to compile per implementation."""
    cfg = get_preset("tiny").replace(index_topk=4)
    x = jax.random.normal(jax.random.key(2), (1, 10, cfg.hidden_size))
    pos = jnp.arange(10, dtype=jnp.int32)[None]
    results, params = [], None
    for impl in ("xla", "pallas"):
        # abstract init + NumPy weights: eager NNX init compiles every initializer (~6 CPU s)
        graphdef, abstract = nnx.split(nnx.eval_shape(
            lambda: GatedDSA(cfg.replace(attention_impl=impl), rngs=nnx.Rngs(0))))
        params = params or random_params(abstract)

        def run(params, graphdef=graphdef):
            def loss(params):
                y = nnx.merge(graphdef, params)(x, positions=pos)[0]
                return jnp.sum(jnp.sin(y)), y
            return jax.value_and_grad(loss, has_aux=True)(params)

        def decode(params, graphdef=graphdef):
            layer = nnx.merge(graphdef, params)
            return layer(x[:, :1], positions=pos[:, 6:7], cache=init_dsa_cache(cfg, 1, 12))[0]

        calls = [str(jax.make_jaxpr(f)(params)).count("pallas_call") for f in (run, decode)]
        assert calls == ([0, 0] if impl == "xla" else [2, 1])  # fwd + bwd kernels; decode fwd
        (_, y), grads = run_jit(run, params)
        results.append((y, jax.tree.leaves(grads)))
    (y0, g0), (y1, g1) = results
    np.testing.assert_allclose(y1, y0, atol=1e-6, rtol=1e-5)
    assert len(g0) == len(g1) > 10
    for a, b in zip(g0, g1):  # summation order differs: measured up to 1.5e-6 abs
        np.testing.assert_allclose(b, a, atol=5e-6, rtol=1e-4)
