"""Sparse MLA attention: Pallas kernels (interpret mode on CPU) vs the XLA references.

Two kernels: ``backend="triton"`` (GPU) and ``"mosaic"`` (TPU; run in the generic interpreter,
once in the TPU simulator ``pltpu.InterpretParams``). References:
``kdsa.model.dsa.sparse_mla_attention`` (gather, autodiff gradients) and
``dense_masked_mla_attention`` (full scores + log multiplicity mask, DeepSeek's formulation).
Inputs hold every edge case at once: -1 slots, indices >= S, duplicated indices, a query with
no valid index, K larger than the keys some queries can see. Measured (f32, main case): max abs
error Triton out 7.2e-7, lse 9.5e-7, dq 1.7e-6, dlatent 2.1e-6, drope 1.4e-6; Mosaic out
7.2e-7, lse 9.5e-7, dq 2.5e-6, dlatent 2.6e-6, drope 2.3e-6 (gradients up to 4.8); decode case
(Triton) out and lse bit-equal, gradients 3.2e-6 (up to 6.7). Lowering is checked for CUDA
(Triton) and TPU (Mosaic); the Mosaic kernel also passes the TPU compiler
(``tests/test_tpu_compile.py``); no hardware has run the kernels.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from kdsa.kernels_pallas import sparse_mla_attention
from kdsa.kernels_pallas.sparse_mla import (dense_masked_mla_attention, kernel,
                                            sparse_mla_attention_ref)
from kdsa.model.config import get_preset
from kdsa.model.dsa import sparse_mla_attention as xla_sparse_mla_attention
from kdsa.model.dsa_cache import init_dsa_cache
from kdsa.model.dsa_layer import GatedDSA
from kdsa.sharding.constrain import use_sharding
from kdsa.sharding.mesh import make_mesh

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


def run_both(q, kv, idx, v_dim, *variants, extra=None):
    """(out, lse, grads, second) of the kernel with each option dict in ``variants``, then of
    the reference (one jit each); with ``extra = (kv2, v_dim2, heads)`` ``second`` is the
    forward output of the first ``heads`` heads for that second key form (default kernel
    options), in the same jit."""
    rng = np.random.default_rng(99)
    w_out = jnp.asarray(rng.normal(size=(*q.shape[:3], v_dim)), jnp.float32)
    w_lse = jnp.asarray(rng.normal(size=q.shape[:3]), jnp.float32)
    argnums = tuple(range(1 + len(kv)))
    res = []
    runs = [(sparse_mla_attention, kw) for kw in variants] + [(sparse_mla_attention_ref, {})]
    for attend, options in runs:
        f = jax.value_and_grad(loss_fn(attend, idx, v_dim, w_out, w_lse, **options),
                               argnums=argnums, has_aux=True)

        def both(q, *kv, attend=attend, f=f):
            (_, (out, lse)), grads = f(q, *kv)
            second = None if extra is None else attend(q[:, :, :extra[2]], extra[0], idx,
                                                       SCALE, extra[1])[0]
            return out, lse, grads, second

        res.append(run_jit(both, q, *kv))
    return res


@pytest.fixture(scope="module")
def main_case():
    """Latent + RoPE key parts. Triton kernel: 2 slot tiles of 8, 2 head blocks of 2 (the
    defaults, one tile and one block, run in the decode and layer tests), backward in 4 query
    chunks; TPU (Mosaic) kernel in the generic interpreter: 2 slot tiles of 8, one block of 8
    heads (4 padded), backward in one chunk (the chunking is the shared ``ops.py`` code).
    Returns the problem, results (triton, mosaic, reference) and the dense-mask reference's
    (out, lse)."""
    q, kv, idx = make_problem(0)
    results = run_both(q, kv, idx, DC, dict(block_k=8, block_h=2, chunk_size=4),
                       dict(backend="mosaic", block_k=8, chunk_size=T))
    dense = run_jit(lambda q, kv, i: dense_masked_mla_attention(q, kv, i, SCALE, DC),
                    q, jnp.concatenate(kv, -1), idx)
    return (q, kv, idx), results, dense


def assert_lse_close(lse, want):
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want))
    np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse), np.where(np.isinf(want), 0, want),
                               **TOL)


@pytest.mark.parametrize("which", [0, 1], ids=["triton", "mosaic"])
def test_forward_matches_both_references(main_case, which):
    _, results, (dout, dlse) = main_case
    (out, lse, _, _), (rout, rlse, _, _) = results[which], results[-1]
    for want_out, want_lse in ((rout, rlse), (dout, dlse)):
        np.testing.assert_allclose(out, want_out, **TOL)
        assert_lse_close(lse, want_lse)
    assert out.shape == (B, T, N, DC) and lse.shape == (B, T, N) and out.dtype == jnp.float32
    assert np.all(np.asarray(out[0, 3]) == 0) and np.all(np.isneginf(np.asarray(lse[0, 3])))


@pytest.mark.parametrize("which", [0, 1], ids=["triton", "mosaic"])
def test_gradients_match_reference_autodiff(main_case, which):
    (q, kv, idx), results, _ = main_case
    grads, rgrads = results[which][2], results[-1][2]
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
    the whole key (one part, forward and gradient) and, with a single head (15 padded), values =
    its first 16 of 24 columns (split once in the wrapper, forward)."""
    q, kv, idx = make_problem(2, b=2, t=1, n=32, s=9, dims=(24,), k=16)
    idx = idx.at[0, 0].set(-1).at[1, 0, 3:6].set(idx[1, 0, 2])  # no valid slot; duplicates
    (out, lse, grads, out16), (rout, rlse, rgrads, rout16) = run_both(
        q, kv, idx, 24, {}, extra=(kv[0], 16, 1))
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


def test_plan_tiles_for_mosaic():
    """TPU plan: heads to the sublane tile (8 f32, 16 bf16) and up to 128 per program, slot
    tiles of up to 128, key widths unpadded; tiles Mosaic cannot take raise."""
    p = kernel.plan(s=100, h=128, k=2048, v_dim=512, d_b=64, backend="mosaic",
                    dtype=jnp.bfloat16)
    assert (p.hp, p.bh, p.kp, p.bk, p.da, p.db) == (128, 128, 2048, 128, 512, 64)
    p = kernel.plan(s=100, h=4, k=13, v_dim=24, d_b=8, backend="mosaic")
    assert (p.hp, p.bh, p.kp, p.bk, p.da, p.db) == (8, 8, 16, 16, 24, 8)
    p = kernel.plan(s=100, h=4, k=0, v_dim=24, d_b=0, backend="mosaic", dtype=jnp.bfloat16)
    assert (p.hp, p.bh, p.kp, p.bk) == (16, 16, 16, 16)
    with pytest.raises(ValueError, match="block_h = 12 must be a multiple of 8"):
        kernel.plan(s=9, h=24, k=8, v_dim=8, d_b=0, block_h=12, backend="mosaic")
    with pytest.raises(ValueError, match="block_k = 8 must be a multiple of 16 for bfloat16"):
        kernel.plan(s=9, h=4, k=8, v_dim=8, d_b=0, block_k=8, backend="mosaic",
                    dtype=jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="float16"):
        kernel.plan(s=9, h=4, k=8, v_dim=8, d_b=0, backend="mosaic", dtype=jnp.float16)
    with pytest.raises(ValueError, match="backend"):
        kernel.plan(s=9, h=4, k=8, v_dim=8, d_b=0, backend="cuda")


def test_tpu_kernel_in_tpu_simulator():
    """The Mosaic kernel in JAX's TPU interpret mode (``pltpu.InterpretParams``: HBM, VMEM and
    SMEM buffers, DMAs run when waited on, semaphores counted, out-of-bounds reads caught):
    one key array (values = the whole key), 12 heads in 2 blocks of 8, 2 slot tiles, a query
    with no valid slot, out-of-range slots and duplicates; forward vs the reference (the
    backward kernel gathers through the same code; its values are checked in the main case in
    the generic interpreter, ~3x cheaper than the simulator)."""
    q, kv, idx = make_problem(4, b=1, t=3, n=12, s=20, dims=(24,), k=16)
    idx = (idx.at[0, 1].set(-1).at[0, 2, 3:6].set(idx[0, 2, 2])
           .at[0, 0, :4].set(jnp.array([20, 25, -3, -1])))
    out, lse = run_jit(lambda q, kv: sparse_mla_attention(
        q, kv, idx, SCALE, 24, backend="mosaic", block_k=8,
        interpret=pltpu.InterpretParams()), q, kv[0])
    rout, rlse = run_jit(lambda q, kv: sparse_mla_attention_ref(q, kv, idx, SCALE, 24), q, kv[0])
    np.testing.assert_allclose(out, rout, **TOL)
    assert_lse_close(lse, rlse)
    assert np.all(np.isneginf(np.asarray(lse[0, 1]))) and np.all(np.asarray(out[0, 1]) == 0)


def test_k3_widths_128_heads_bf16_both_backends():
    """bfloat16 inputs at K3 widths (latent 512 + RoPE key 64, v_dim 512) and 128 heads
    (Triton: 2 head blocks of 64; Mosaic: one of 128), 3 queries, 40 keys, top-24 with -1
    slots: both kernels' forward vs the reference on the same bf16 inputs (it computes in
    float32). The kernels round the probabilities to bf16 before ``p @ V`` (as FlashMLA does):
    measured max abs error out 4.3e-3 (values up to 2.3), lse 4.8e-7."""
    q, kv, idx = make_problem(5, b=1, t=3, n=128, s=40, dims=(512, 64), k=24)
    q = q.astype(jnp.bfloat16) * 0.1            # scores of a few units, as in trained models
    kv = tuple(x.astype(jnp.bfloat16) for x in kv)

    def all_three(q, kv, idx):
        return [attend(q, kv, idx, SCALE, 512, **kw) for attend, kw in (
            (sparse_mla_attention, {}), (sparse_mla_attention, dict(backend="mosaic")),
            (sparse_mla_attention_ref, {}))]
    (tout, tlse), (mout, mlse), (rout, rlse) = run_jit(all_three, q, kv, idx)
    for out, lse in ((tout, tlse), (mout, mlse)):
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(out, rout, atol=1e-2, rtol=0)
        assert_lse_close(lse, rlse)


def test_mosaic_bf16_row_pairs_odd_pool_and_garbage_rows():
    """The Mosaic kernel's 16-bit gather (rows read as uint32 row pairs, the selected half
    unpacked in registers), forward and gradients, in the generic interpreter: bf16 key parts
    (latent 32 + RoPE 8) with an odd number of rows (the kernel pads one), batch 1 (as the
    layer's paged path calls it: queries against a pool of rows, -1 unused), both parities of
    selected rows, 2 slot tiles of 16, and NaN in rows 0 and 1 (the pair invalid
    slots read: unused pool rows), which the kernel zeroes, so every result stays finite.
    Against the reference on the same bf16 inputs with those rows zeroed (no valid slot selects
    them). Measured: max abs error out 1.9e-3 (values up to 1.5), lse 4.8e-7, dq 7.8e-3,
    dlatent 7.8e-3, drope 9.8e-4 (gradients up to 3.3; bf16 rounding of p and the gradients);
    the test fails without the zeroing."""
    q, kv, idx = make_problem(7, b=1, t=5, n=16, s=21, dims=(DC, DR), k=32)
    idx = jnp.where((idx == 0) | (idx == 1), 2, idx).at[0, 2, :].set(-1).at[0, 3, 10:].set(-1)
    q = (q * 0.3).astype(jnp.bfloat16)
    kv = tuple(x.astype(jnp.bfloat16) for x in kv)
    dirty = tuple(x.at[0, :2].set(jnp.nan) for x in kv)
    ii = np.asarray(idx)
    assert (ii % 2 == 0).any() and (ii % 2 == 1).any() and not ((ii == 0) | (ii == 1)).any()
    rng = np.random.default_rng(3)
    w_out = jnp.asarray(rng.normal(size=(1, 5, 16, DC)), jnp.float32)
    w_lse = jnp.asarray(rng.normal(size=(1, 5, 16)), jnp.float32)

    def grads(attend, kv, **kw):
        f = jax.value_and_grad(loss_fn(attend, idx, DC, w_out, w_lse, **kw), argnums=(0, 1, 2),
                               has_aux=True)
        (_, (out, lse)), g = f(q, *kv)
        return out, lse, g

    (out, lse, g), (rout, rlse, rg) = run_jit(lambda d, c: (
        grads(sparse_mla_attention, d, backend="mosaic", block_k=16),
        grads(sparse_mla_attention_ref, c)), dirty, kv)
    np.testing.assert_allclose(out, rout, atol=1e-2, rtol=0)
    assert_lse_close(lse, rlse)
    for name, a, b in zip(("dq", "dlatent", "drope"), g, rg):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(a)), name
        np.testing.assert_allclose(a, b, atol=4e-2, rtol=2e-2, err_msg=name)
    assert np.all(np.asarray(g[1], np.float32)[0, :2] == 0)     # rows 0, 1: never validly read
    with pytest.raises(NotImplementedError, match="simulator"):
        sparse_mla_attention(q, kv, idx, SCALE, DC, backend="mosaic",
                             interpret=pltpu.InterpretParams())


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
    with pytest.raises(ValueError, match="needs backend='mosaic'"):
        sparse_mla_attention(q, kv, idx, SCALE, DC, interpret=pltpu.InterpretParams())
    with pytest.raises(NotImplementedError, match="float16"):
        sparse_mla_attention(q.astype(jnp.float16), tuple(x.astype(jnp.float16) for x in kv),
                             idx, SCALE, DC, backend="mosaic")
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


def test_lowers_for_tpu_mosaic():
    """Forward and backward go through the Pallas -> Mosaic lowering for TPU
    (``jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))``: block shapes, SMEM / ANY
    memory spaces, DMAs and semaphores): K3 widths (latent 512, RoPE key 64, 128 heads, top-2048)
    in bf16, and one key array (v_dim = Dk = 40) with 20 heads, top-200, in 2 query chunks, f32.
    Not Mosaic's compiler passes, which run inside libtpu on a TPU."""
    cases = [((1, 2, 128, 576), (512, 64), 2048, jnp.bfloat16),
             ((1, 5, 20, 40), (40,), 200, jnp.float32)]
    for q_shape, dims, k, dtype in cases:
        args = ([jax.ShapeDtypeStruct(q_shape, dtype)]
                + [jax.ShapeDtypeStruct((1, 300, d), dtype) for d in dims]
                + [jax.ShapeDtypeStruct(q_shape[:2] + (k,), jnp.int32)])

        def grad(q, *rest, dims=dims):
            kv, i = rest[:-1], rest[-1]
            f = lambda q, *kv: jnp.sum(sparse_mla_attention(  # noqa: E731
                q, kv, i, 0.1, dims[0], backend="mosaic", interpret=False, chunk_size=3)[0])
            return jax.grad(f, argnums=tuple(range(1 + len(kv))))(q, *kv)

        text = jax.jit(grad).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        assert text.count("tpu_custom_call") >= 2, (q_shape, dtype)    # forward + backward


def random_params(abstract):
    """Gaussian weights ``fan_in**-0.5`` (matrices), ``1 + 0.1 N(0, 1)`` (norm scales)."""
    rng = np.random.default_rng(5)

    def draw(a):
        if len(a.shape) == 1:
            return jnp.asarray(1.0 + 0.1 * rng.normal(size=a.shape), a.dtype)
        return jnp.asarray(rng.normal(size=a.shape) * a.shape[0] ** -0.5, a.dtype)
    return jax.tree.map(draw, abstract)


LAYER_CFG = get_preset("tiny").replace(index_topk=4)


def _layer_run(impl, params, x, pos):
    """(graphdef, jitted loss-and-grad fn, decode fn) of the ``tiny`` Gated DSA layer."""
    # abstract init + NumPy weights: eager NNX init compiles every initializer (~6 CPU s)
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: GatedDSA(LAYER_CFG.replace(attention_impl=impl), rngs=nnx.Rngs(0))))
    params = params or random_params(abstract)

    def run(params):
        def loss(params):
            y = nnx.merge(graphdef, params)(x, positions=pos)[0]
            return jnp.sum(jnp.sin(y)), y
        return jax.value_and_grad(loss, has_aux=True)(params)

    def decode(params):
        layer = nnx.merge(graphdef, params)
        return layer(x[:1, :1], positions=pos[:1, 6:7], cache=init_dsa_cache(LAYER_CFG, 1, 12))[0]
    return params, run, decode


@pytest.fixture(scope="module")
def layer_case():
    """The ``tiny`` preset's Gated DSA layer (4 heads, latent 32 + RoPE key 8, top-4 of 10
    tokens, batch 2), single device: XLA attention's output and parameter gradients."""
    x = jax.random.normal(jax.random.key(2), (2, 10, LAYER_CFG.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (2, 10))
    params, run, _ = _layer_run("xla", None, x, pos)
    (_, y), grads = run_jit(run, params)
    return x, pos, params, y, jax.tree.leaves(grads)


def _assert_layer_close(y, grads, want_y, want_grads):
    np.testing.assert_allclose(y, want_y, atol=1e-6, rtol=1e-5)
    assert len(grads) == len(want_grads) > 10
    for a, b in zip(want_grads, grads):  # summation order differs: measured up to 1.5e-6 abs
        np.testing.assert_allclose(b, a, atol=5e-6, rtol=1e-4)


def test_gated_dsa_layer_routes_to_the_kernel(layer_case):
    """``attention_impl="pallas"`` puts the kernel (forward and backward) in the layer's
    training program and its forward in the cache (prefill / decode) path; ``"xla"`` none. The
    values are checked under sequence parallelism below (the same layer code and kernel, with
    the shard_map around it); the whole tiny Transformer is not used: its gradient takes ~80
    CPU seconds to compile per implementation."""
    x, pos, params, _, _ = layer_case
    for impl in ("xla", "pallas"):
        _, run, decode = _layer_run(impl, params, x, pos)
        calls = [str(jax.make_jaxpr(f)(params)).count("pallas_call") for f in (run, decode)]
        assert calls == ([0, 0] if impl == "xla" else [2, 1])  # fwd + bwd kernels; decode fwd


def test_gated_dsa_layer_pallas_sequence_parallel_matches_single_device_xla(layer_case):
    """The layer with ``attention_impl="pallas"`` under the ``train`` rules on a
    ``sequence=2,tensor=2,fsdp=2`` mesh (queries split over sequence, keys all-gathered, heads
    over tensor, batch over fsdp: ``sharding/context_parallel.py``'s shard_map around the
    kernel) equals the single-device XLA layer, output and every parameter gradient. Measured:
    output 4.8e-7, gradients 3.8e-6 max abs (gradients up to 26)."""
    x, pos, params, want_y, want_grads = layer_case
    _, run, _ = _layer_run("pallas", params, x, pos)
    with use_sharding(make_mesh("sequence=2,tensor=2,fsdp=2"), "train"):
        lowered = jax.jit(run).trace(params).lower()
        text = lowered.as_text()
        assert "all_gather" in text or "all-gather" in text
        (_, y), grads = lowered.compile(
            compiler_options={"xla_backend_optimization_level": 0})(params)
    _assert_layer_close(y, jax.tree.leaves(grads), want_y, want_grads)


def test_gated_dsa_layer_pallas_on_a_mesh_without_sequence_split(layer_case):
    """Without a sequence split (the ``train`` rules on ``fsdp=2,expert=2,tensor=2``; the cache
    path under ``generate``) the kernel still runs inside a ``shard_map`` over the batch and
    heads: XLA cannot partition a Mosaic or Triton call (on TPU the train step failed with
    "Mosaic kernels cannot be automatically partitioned"). Equal to the single-device XLA layer,
    output and every parameter gradient; a decode step over the dense-slot cache equal too."""
    x, pos, params, want_y, want_grads = layer_case
    _, run, decode = _layer_run("pallas", params, x, pos)
    _, _, decode_xla = _layer_run("xla", params, x, pos)
    with use_sharding(make_mesh("fsdp=2,expert=2,tensor=2"), "train"):
        assert "shard_map" in str(jax.make_jaxpr(run)(params))
        (_, y), grads = jax.jit(run).trace(params).lower().compile(
            compiler_options={"xla_backend_optimization_level": 0})(params)
    _assert_layer_close(y, jax.tree.leaves(grads), want_y, want_grads)
    with use_sharding(make_mesh("expert=4,tensor=2"), "generate"):
        assert "shard_map" in str(jax.make_jaxpr(decode)(params))
        y_dec = jax.jit(decode)(params)
    np.testing.assert_allclose(y_dec, jax.jit(decode_xla)(params), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("attend,kw", [
    (sparse_mla_attention, {"backend": "triton"}),
    (sparse_mla_attention_ref, {}),
    (xla_sparse_mla_attention, {})], ids=["triton", "kernel-ref", "xla"])
def test_unused_slots_never_read_a_non_finite_row(attend, kw):
    """Unused slots (-1, >= S) read row 0 and must contribute nothing even when it is not
    finite (in the paged pool, row 0 is another request's token): outputs and gradients stay
    finite and equal those with row 0 zeroed. Before, the Triton kernel and both XLA
    references gave NaN for every query with an unused slot (0 x NaN); the Mosaic kernel
    zeroed them (test above)."""
    q, kv, idx = make_problem(11)
    idx = jnp.where(idx == 0, 1, idx)  # no valid slot selects row 0
    assert bool((idx < 0).any())
    dirty = tuple(x.at[:, 0].set(jnp.nan) for x in kv)
    clean = tuple(x.at[:, 0].set(0.0) for x in kv)
    rng = np.random.default_rng(5)
    w_out = jnp.asarray(rng.normal(size=(*q.shape[:3], DC)), jnp.float32)
    w_lse = jnp.asarray(rng.normal(size=q.shape[:3]), jnp.float32)

    def run(kv):
        f = jax.value_and_grad(loss_fn(attend, idx, DC, w_out, w_lse, **kw), argnums=(0, 1, 2),
                               has_aux=True)
        (_, (out, _)), g = f(q, *kv)
        return out, g

    (out, g), (rout, rg) = run_jit(lambda d, c: (run(d), run(c)), dirty, clean)
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(out, rout, **TOL)
    for a, b in zip(g, rg):
        a = np.asarray(a)
        assert np.all(np.isfinite(a[:, 1:] if a.ndim == 3 and a.shape[1] == S else a))
        np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(np.asarray(b)), **TOL)
