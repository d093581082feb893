"""Paged lightning-indexer scores (``kdsa.kernels_pallas.paged_index``): the Triton (GPU) and
Mosaic (TPU) kernels in interpret mode on CPU, the Mosaic one also in the TPU simulator
(``pltpu.InterpretParams``), against the reference, which gathers the keys into a copy and
scores them; the reference against the model's own ``indexer_scores``; the Triton kernel
through the Pallas -> Triton lowering for CUDA. The TPU compile is in
``tests/test_tpu_compile.py``, the model path (a paged decode step with
``attention_impl="pallas"``) in ``tests/test_paged_cache.py``."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kdsa.kernels_pallas.paged_index import paged_index_scores, paged_index_scores_ref
from kdsa.kernels_pallas.paged_index.kernel import check_tiles
from kdsa.kernels_pallas.paged_index.ops import default_pages_per_block, supports
from kdsa.model.dsa import indexer_scores

PAGE, PAGES, W = 16, 24, 21
# rows: -1 pages between and after real ones, a page twice in one row and in two rows
# (prefix sharing), a row without pages; W = 21 pages: 3 or 2 blocks of 8 or 16 pages, the
# last one partly padding
TABLE = np.full((4, W), -1, np.int32)
TABLE[0, :6] = [3, -1, 7, 0, 9, 23]
TABLE[0, 17:] = [22, -1, 11, 12]
TABLE[1, :2] = [1, 2]
TABLE[2] = [8, 8] + np.random.default_rng(1).permutation(PAGES)[:W - 2].tolist()


def _inputs(dtype, t=2, j=5, d=16, seed=0):
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((PAGES * PAGE + 1, d)).astype(np.float32)
    pool[-1] = np.nan  # the scratch row: never a page's row
    q = rng.standard_normal((len(TABLE), t, j, d)).astype(np.float32)
    w = rng.standard_normal((len(TABLE), t, j)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(w), jnp.asarray(pool, dtype),
            jnp.asarray(TABLE, jnp.int32))


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("ppb", [8, 16])
def test_kernel_equals_the_reference(backend, dtype, ppb):
    q, w, pool, table = _inputs(dtype)
    want = np.asarray(paged_index_scores_ref(q, w, pool, table, PAGE))
    got = np.asarray(jax.jit(lambda *a: paged_index_scores(
        *a, PAGE, backend=backend, pages_per_block=ppb))(q, w, pool, table))
    assert got.shape == want.shape == (len(TABLE), 2, W * PAGE)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.all(got[0, :, PAGE:2 * PAGE] == 0) and np.all(got[3] == 0)  # -1 pages: 0
    np.testing.assert_array_equal(got[2, :, :PAGE], got[2, :, PAGE:2 * PAGE])  # page 8 twice
    assert np.abs(want).max() > 1


def test_kernel_in_the_tpu_simulator():
    """DMAs, semaphores and SMEM modelled (out-of-bounds accesses would fail): f32, one query."""
    q, w, pool, table = _inputs(jnp.float32, t=1, j=8)
    want = np.asarray(paged_index_scores_ref(q, w, pool, table, PAGE))
    got = np.asarray(paged_index_scores(q, w, pool, table, PAGE, backend="mosaic",
                                        pages_per_block=8, interpret=pltpu.InterpretParams()))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_reference_equals_the_models_scores_on_gathered_keys():
    q, w, pool, table = _inputs(jnp.float32)
    rows = np.maximum(TABLE[:, :, None] * PAGE + np.arange(PAGE), 0).reshape(4, -1)
    model = np.asarray(indexer_scores(q, pool[rows], w))
    backed = np.repeat(TABLE >= 0, PAGE, axis=1)[:, None]
    want = np.asarray(paged_index_scores_ref(q, w, pool, table, PAGE))
    np.testing.assert_allclose(np.where(backed, model, 0.0), want, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_clear_errors():
    q, w, pool, table = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="weights must be"):
        paged_index_scores(q, w[:, :1], pool, table, PAGE)
    with pytest.raises(ValueError, match="pool must be"):
        paged_index_scores(q, w, pool[:, :8], table, PAGE)
    with pytest.raises(ValueError, match="block_table must be"):
        paged_index_scores(q, w, pool, table[:2], PAGE)
    with pytest.raises(ValueError, match="multiple of 8"):
        paged_index_scores(q, w, pool, table, 12, backend="mosaic", pages_per_block=32)
    with pytest.raises(ValueError, match="multiple of 128"):
        paged_index_scores(q, w, pool, table, PAGE, backend="mosaic", pages_per_block=3)
    with pytest.raises(ValueError, match="power of two"):
        paged_index_scores(q, w, pool, table, 12, backend="triton", pages_per_block=32)
    with pytest.raises(ValueError, match="index key width D = 24"):
        paged_index_scores(q[..., :12].repeat(2, -1), w, pool[:, :12].repeat(2, -1), table,
                           PAGE, backend="triton")
    with pytest.raises(ValueError, match="impl must be"):
        paged_index_scores(q, w, pool, table, PAGE, impl="cuda")
    with pytest.raises(ValueError, match="backend must be"):
        paged_index_scores(q, w, pool, table, PAGE, backend="cuda")
    with pytest.raises(NotImplementedError, match="float16"):
        paged_index_scores(q.astype(jnp.float16), w, pool.astype(jnp.float16), table, PAGE,
                           backend="mosaic")
    with pytest.raises(NotImplementedError, match="use backend='mosaic'"):
        paged_index_scores(q, w, pool, table, PAGE, backend="triton",
                           interpret=pltpu.InterpretParams())
    with pytest.raises(ValueError, match="must share a dtype"):
        paged_index_scores(q, w, pool.astype(jnp.bfloat16), table, PAGE)
    with pytest.raises(ValueError, match="int32 offsets"):  # 1-byte keys, 2^31 .. 2^32 bytes
        check_tiles(128, 64, 8, pool_rows=2 ** 24 + 1, itemsize=1)
    check_tiles(128, 64, 8, pool_rows=2 ** 24 + 1)  # 2-byte keys: 64-bit offsets past 4 GiB
    assert default_pages_per_block(64) == 8 and default_pages_per_block(32) == 16
    assert default_pages_per_block(64, 2048) == 32
    # where a kernel's tiles do not fit, the model keeps XLA's path (model/paged_attention.py)
    assert supports(128, 64, 1 << 20, "triton") and supports(16, 64, 1 << 20, "mosaic")
    assert not supports(24, 64, 1 << 20, "triton")
    assert not supports(128, 64, (1 << 24) + 1, "triton", jnp.int8)  # 1-byte keys past 2^31
    assert supports(128, 64, (1 << 24) + 1, "triton")  # bfloat16: 64-bit offsets past 4 GiB
    assert not supports(128, 12, 1 << 20, "mosaic")


def test_triton_kernel_lowers_for_cuda():
    """The Triton kernel goes through the Pallas -> Triton lowering for CUDA at K3's widths (64
    index heads of 128, bfloat16, 8 rows x 256 pages); not the Triton compiler itself."""
    from jax._src import mesh as mesh_lib

    shapes = [jax.ShapeDtypeStruct(sh, dt) for sh, dt in (
        ((8, 1, 64, 128), jnp.bfloat16), ((8, 1, 64), jnp.float32),
        ((1025 * 64, 128), jnp.bfloat16), ((8, 256), jnp.int32))]
    device = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(
            jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        warnings.simplefilter("ignore")                  # Pallas Triton deprecation notice
        exported = jax.export.export(
            jax.jit(lambda q, w, pool, table: paged_index_scores(
                q, w, pool, table, 64, backend="triton", interpret=False)),
            platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
                "__gpu$xla.gpu.triton")])(*shapes)
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") >= 1
