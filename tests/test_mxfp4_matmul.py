"""MXFP4 matmul: Pallas kernels (interpret mode on CPU) vs the XLA reference vs float64 NumPy.

"Exact data" (integer activations, weight scales in a narrow range per output row) makes every
partial sum exact in float32, so any summation order gives the same bits: there the kernel, the
reference and the float64 product must agree bit for bit. Gaussian data differ only by summation
order: |kernel - float64| <= 1e-6 * (|x| @ |W|^T) (measured ~1.3e-7, reference ~2.3e-7).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdsa.kernels_pallas import common
from kdsa.kernels_pallas.mxfp4_matmul import (dequantize_prepared, kernel,
                                              mxfp4_grouped_matmul,
                                              mxfp4_grouped_matmul_prepared,
                                              mxfp4_grouped_matmul_ref, mxfp4_matmul,
                                              mxfp4_matmul_ref, prepare_mxfp4_weights)
from kdsa.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4

LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

pallas_dense = jax.jit(mxfp4_matmul)
ref_dense = jax.jit(mxfp4_matmul_ref)
ref_grouped = jax.jit(mxfp4_grouped_matmul_ref)
quant = jax.jit(quantize_mxfp4)
dequant_f32 = jax.jit(lambda b, s: dequantize_mxfp4(b, s, jnp.float32))
prepare = jax.jit(prepare_mxfp4_weights)


def np_weight(blocks, scales):
    """Independent float64 dequantisation: LUT[code] * 2^(scale - 127), low nibble first."""
    b, s = np.asarray(blocks), np.asarray(scales).astype(np.int64)
    codes = np.stack([b & 0xF, b >> 4], -1).reshape(*b.shape[:-1], 32)
    with np.errstate(over="ignore"):
        w = LUT[codes] * np.ldexp(1.0, s - 127)[..., None]
    return w.reshape(*w.shape[:-2], -1)                                    # [..., N, K]


def exact_weight(rng, lead, k, lo=-3, hi=3):
    """Random codes (all 16 present) with scale codes 127 + [lo, hi]."""
    codes = rng.integers(0, 16, (*lead, k))
    codes.reshape(-1)[:16] = np.arange(16)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    blocks = blocks.reshape(*lead, k // 32, 16)
    scales = (127 + rng.integers(lo, hi + 1, (*lead, k // 32))).astype(np.uint8)
    return jnp.asarray(blocks), jnp.asarray(scales)


def int_x(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.integers(-4, 5, shape) * scale, dtype)


def assert_bits_equal(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_array_equal(a, b)                                    # NaN == NaN here
    fin = np.isfinite(a)
    np.testing.assert_array_equal(a[fin].view(np.uint32), b[fin].view(np.uint32))


def assert_close_to_f64(y, x, w64, tol=1e-6):
    x64 = np.asarray(x, np.float64)
    want = x64 @ w64.T
    bound = tol * (np.abs(x64) @ np.abs(w64).T) + 1e-30
    assert (np.abs(np.asarray(y, np.float64) - want) <= bound).all()


F32, BF16 = jnp.float32, jnp.bfloat16
# every M in {1, 3, 16, 130}, K in {32, 64, 256}, N in {8, 48, 256}, each dtype on several shapes
CASES = [(1, 32, 8, F32), (3, 64, 48, BF16), (16, 256, 256, F32), (130, 256, 8, BF16),
         (1, 256, 48, BF16), (130, 32, 256, F32), (16, 64, 48, BF16), (3, 256, 8, F32)]


@pytest.mark.parametrize("m,k,n,dtype", CASES,
                         ids=[f"{m}x{k}x{n}-{jnp.dtype(d).name}" for m, k, n, d in CASES])
def test_dense_matches_reference(m, k, n, dtype):
    rng = np.random.default_rng(m * 1000 + k + n)
    blocks, scales = exact_weight(rng, (n,), k)
    x = int_x(rng, (m, k), dtype)
    y = pallas_dense(x, blocks, scales)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    assert_bits_equal(y, ref_dense(x, blocks, scales))
    assert_bits_equal(y, np.asarray(x, np.float64) @ np_weight(blocks, scales).T)
    # Gaussian data: same compiled kernel, summation-order differences only
    xg = jnp.asarray(rng.standard_normal((m, k)), dtype)
    bg, sg = quant(jnp.asarray(rng.standard_normal((n, k)), jnp.float32))
    yg = pallas_dense(xg, bg, sg)
    assert_close_to_f64(yg, xg, np_weight(bg, sg))
    assert_close_to_f64(ref_dense(xg, bg, sg), xg, np_weight(bg, sg))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_dense_extreme_scales(dtype):
    """Rows with constant scale codes 0..254 (subnormal weights, overflow to inf at 253/254):
    activations 2^20 x ints for the low rows and 2^-20 x ints for the high rows keep every
    product's partial sums exact, so NaN/inf/finite patterns and bits must match exactly."""
    rng = np.random.default_rng(7)
    low, high = [0, 1, 2, 3, 10, 60], [127, 200, 250, 252, 253, 254]
    blocks, _ = exact_weight(rng, (12,), 64)
    scales = jnp.asarray(np.repeat(np.array(low + high, np.uint8)[:, None], 2, 1))
    for rows, scale in ((slice(0, 6), 2.0 ** 20), (slice(6, 12), 2.0 ** -20)):
        x = int_x(rng, (5, 64), dtype, scale)
        y = np.asarray(pallas_dense(x, blocks, scales))[:, rows]
        assert_bits_equal(y, np.asarray(ref_dense(x, blocks, scales))[:, rows])
    assert np.isinf(np.asarray(dequant_f32(blocks, scales))[-1]).any()


def grouped_case(rng, dtype, exact=True):
    e, m, k, n = 5, 37, 64, 48
    if exact:
        blocks, scales = exact_weight(rng, (e, n), k)
        x = int_x(rng, (m, k), dtype)
    else:
        blocks, scales = quant(jnp.asarray(rng.standard_normal((e, n, k)), jnp.float32))
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    return x, blocks, scales


def np_grouped(x, blocks, scales, sizes):
    w = np_weight(blocks, scales)
    x64 = np.asarray(x, np.float64)
    y = np.zeros((x64.shape[0], w.shape[1]))
    start = 0
    for e, g in enumerate(sizes):
        y[start:start + g] = x64[start:start + g] @ w[e].T
        start += g
    return y


GROUPS = [[7, 0, 13, 0, 9], [0, 0, 37, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]


@pytest.mark.parametrize("mode", ["gather", "prefetch"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_grouped_matches_reference(dtype, mode):
    """Empty groups, a group spanning several row tiles, rows past sum(group_sizes) (-> 0)."""
    rng = np.random.default_rng(8)
    x, blocks, scales = grouped_case(rng, dtype)
    w = prepare(blocks, scales)
    run = jax.jit(lambda x, w, g: mxfp4_grouped_matmul_prepared(x, w, g, mode=mode))
    for sizes in GROUPS:
        g = jnp.asarray(sizes, jnp.int32)
        y = run(x, w, g)
        assert_bits_equal(y, ref_grouped(x, blocks, scales, g))
        assert_bits_equal(y, np_grouped(x, blocks, scales, sizes))
        assert (np.asarray(y)[sum(sizes):] == 0).all()
    x, blocks, scales = grouped_case(rng, dtype, exact=False)
    sizes = GROUPS[0]
    y = np.asarray(run(x, prepare(blocks, scales), jnp.asarray(sizes, jnp.int32)))
    w64 = np_weight(blocks, scales)
    start = 0
    for e, gsz in enumerate(sizes):
        assert_close_to_f64(y[start:start + gsz], x[start:start + gsz], w64[e])
        start += gsz


def test_gradient_wrt_x_matches_reference_autodiff():
    rng = np.random.default_rng(9)
    blocks, scales = exact_weight(rng, (48,), 64)
    x = jnp.asarray(rng.standard_normal((3, 5, 64)), jnp.float32)          # leading dims
    c = jnp.asarray(rng.standard_normal((3, 5, 48)), jnp.float32)
    loss = lambda impl: lambda x: jnp.sum(mxfp4_matmul(x, blocks, scales, impl=impl) * c)
    gp = jax.jit(jax.grad(loss("pallas")))(x)
    gr = jax.jit(jax.grad(loss("xla")))(x)
    np.testing.assert_allclose(np.asarray(gp), np.asarray(gr), rtol=1e-6, atol=1e-6)
    xb = x.astype(jnp.bfloat16)
    assert jax.grad(loss("pallas"))(xb).dtype == jnp.bfloat16

    xg, bg, sg = grouped_case(rng, jnp.float32, exact=False)
    g = jnp.asarray(GROUPS[0], jnp.int32)
    cg = jnp.asarray(rng.standard_normal((37, 48)), jnp.float32)
    gloss = lambda impl: lambda x: jnp.sum(mxfp4_grouped_matmul(x, bg, sg, g, impl=impl) * cg)
    gp = jax.jit(jax.grad(gloss("pallas")))(xg)
    gr = jax.jit(jax.grad(gloss("xla")))(xg)
    np.testing.assert_allclose(np.asarray(gp), np.asarray(gr), rtol=1e-6, atol=1e-6)
    assert (np.asarray(gp)[29:] == 0).all()


def test_prepared_layout_round_trip():
    rng = np.random.default_rng(10)
    for lead in ((48,), (3, 40)):                                          # N padded to 64
        blocks, scales = exact_weight(rng, lead, 96, lo=-127, hi=127)     # K padded to 128
        w = prepare(blocks, scales)
        assert w.packed.shape[-2:] == (64, 64) and w.scales.shape[-2:] == (4, 64)
        want = jnp.swapaxes(dequant_f32(blocks, scales), -1, -2)
        assert_bits_equal(jax.jit(dequantize_prepared)(w), want)


def test_bad_inputs_raise():
    rng = np.random.default_rng(11)
    blocks, scales = exact_weight(rng, (16,), 64)
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="does not match the weight's K = 64"):
        mxfp4_matmul(jnp.ones((2, 96)), blocks, scales)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        mxfp4_matmul(x.astype(jnp.float16), blocks, scales)
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_matmul(x, blocks.astype(jnp.int8), scales)
    with pytest.raises(ValueError, match=r"expected blocks \[N, K/32, 16\]"):
        mxfp4_matmul(x, blocks, scales[:, :1])
    with pytest.raises(ValueError, match="impl"):
        mxfp4_matmul(x, blocks, scales, impl="cuda")
    with pytest.raises(ValueError, match="power of two"):
        mxfp4_matmul(x, blocks, scales, block_sizes=common.BlockSizes(block_m=8, block_n=24,
                                                                      block_k=64))
    with pytest.raises(ValueError, match="multiple of 32"):
        common.BlockSizes(block_m=8, block_n=8, block_k=48)
    eb, es = exact_weight(rng, (3, 16), 64)
    with pytest.raises(ValueError, match=r"group_sizes must be integer \[E=3\]"):
        mxfp4_grouped_matmul(x, eb, es, jnp.array([1, 1], jnp.int32))
    with pytest.raises(ValueError, match="sum <= M = 2"):
        mxfp4_grouped_matmul(x, eb, es, jnp.array([1, 1, 1], jnp.int32))
    with pytest.raises(ValueError, match="x_sorted must be"):
        mxfp4_grouped_matmul(x[None], eb, es, jnp.array([1, 1, 0], jnp.int32))
    with pytest.raises(ValueError, match="mode"):
        mxfp4_grouped_matmul_prepared(x, prepare_mxfp4_weights(eb, es),
                                      jnp.array([1, 1, 0], jnp.int32), mode="scatter")


def _export(fn, x, platform):
    """Lower for a platform this machine lacks: runs the Pallas -> Triton / Mosaic lowering
    (the kernel's primitives, block shapes, scalar prefetch), not the Triton/TPU compilers."""
    from jax._src import mesh as mesh_lib
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                 # Pallas Triton deprecation notice
        if platform == "tpu":
            return jax.export.export(jax.jit(fn), platforms=["tpu"])(x)
        device = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                         platform="gpu")
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                      abstract_device=device)):
            return jax.export.export(
                jax.jit(fn), platforms=["cuda"],
                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
                    "__gpu$xla.gpu.triton")])(x)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_kernels_lower_for_triton_and_mosaic(platform):
    rng = np.random.default_rng(12)
    blocks, scales = exact_weight(rng, (4, 256), 1024)
    wd = prepare_mxfp4_weights(blocks[0], scales[0], platform=platform)
    wg = prepare_mxfp4_weights(blocks, scales, platform=platform)
    g = jnp.array([1, 0, 2, 1], jnp.int32)
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jax.ShapeDtypeStruct((4, 1024), dtype)
        dense = _export(lambda x: kernel.mxfp4_matmul_prepared(
            x, wd, interpret=False, platform=platform), x, platform)
        grouped = _export(lambda x: kernel.mxfp4_grouped_matmul_prepared(
            x, wg, g, interpret=False, platform=platform), x, platform)
        target = "triton" if platform == "gpu" else "tpu_custom_call"
        assert target in dense.mlir_module() and target in grouped.mlir_module()


def test_empty_inputs():
    rng = np.random.default_rng(13)
    blocks, scales = exact_weight(rng, (3, 16), 64)
    assert mxfp4_matmul(jnp.zeros((0, 64)), blocks[0], scales[0]).shape == (0, 16)
    y = mxfp4_grouped_matmul(jnp.zeros((0, 64)), blocks, scales, jnp.zeros((3,), jnp.int32))
    assert y.shape == (0, 16)


@pytest.mark.parametrize("k,block_k", [(96, 32), (320, 64)], ids=["3-tiles", "5-tiles"])
def test_several_k_tiles_dense_and_grouped(k, block_k):
    """More than one contracting tile (every other case fits one: ``block_k`` defaults to 256):
    the per-tile offsets of the packed bytes and the scales, and K padded to a multiple of
    ``block_k`` (320 = 5 x 64; 96 = 3 x 32), bit-exact against the reference and float64."""
    from kdsa.kernels_pallas import common
    from kdsa.kernels_pallas.mxfp4_matmul.kernel import mxfp4_grouped_matmul

    rng = np.random.default_rng(k)
    bs = common.BlockSizes(block_m=8, block_n=8, block_k=block_k)
    blocks, scales = exact_weight(rng, (16,), k)
    x = int_x(rng, (9, k), jnp.float32)
    y = jax.jit(lambda x, b, s: mxfp4_matmul(x, b, s, block_sizes=bs))(x, blocks, scales)
    assert_bits_equal(y, ref_dense(x, blocks, scales))
    assert_bits_equal(y, np.asarray(x, np.float64) @ np_weight(blocks, scales).T)
    gb, gs = exact_weight(rng, (3, 16), k)
    sizes = [4, 0, 5]
    g = jnp.asarray(sizes, jnp.int32)
    yg = jax.jit(lambda x, b, s, g: mxfp4_grouped_matmul(x, b, s, g, block_sizes=bs))(
        x, gb, gs, g)
    assert_bits_equal(yg, ref_grouped(x, gb, gs, g))
    assert_bits_equal(yg, np_grouped(x, gb, gs, sizes))
