"""MXFP4 experts under expert parallelism: each device multiplies its own experts' bytes inside
the expert-parallel ``shard_map`` (``stacked_experts.PackedMatrix`` through
``expert_parallel.experts_sharded``; the grouped MXFP4 matmul, XLA's exact dequantisation or
the Pallas kernel in interpret mode), equal to the MXFP4 experts on one device, values and
gradients; the MoE layer hands the exchange the bytes, never a dequantised copy of the layer
(before, every device dequantised the whole layer's experts outside the ``shard_map``)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdsa.model.config import get_preset
from kdsa.model.expert_parallel import experts_sharded
from kdsa.model.moe import MoE, experts_ragged
from kdsa.model.moe_mxfp4 import pack_expert_weight
from kdsa.model.stacked_experts import PackedMatrix
from kdsa.sharding.constrain import use_sharding
from kdsa.sharding.mesh import make_mesh

# I = 64: over tensor=2 each device holds 32 of w2's contracting columns, one whole MXFP4 block
CONFIG = get_preset("tiny").replace(moe_intermediate_size=64, expert_weight_format="mxfp4")


@pytest.fixture(scope="module")
def inputs():
    e, de, i, n, k = (CONFIG.num_experts, CONFIG.expert_hidden_size,
                      CONFIG.moe_intermediate_size, 32, 2)
    ks = jax.random.split(jax.random.key(0), 6)
    z = jax.random.normal(ks[0], (n, de))
    idx = jax.vmap(lambda kk: jax.random.permutation(kk, e)[:k])(jax.random.split(ks[1], n))
    w = jax.random.uniform(ks[2], (n, k))
    packed = jax.jit(lambda ks: [a for kk, s in zip(ks, ((e, de, i), (e, de, i), (e, i, de)))
                                 for a in pack_expert_weight(jax.random.normal(kk, s) * 0.2)])(
        ks[3:])
    return z, idx.astype(jnp.int32), w, packed


def _loss_and_grads(fn):
    def loss(z, w):
        y = fn(z, w)
        y, extra = y if isinstance(y, tuple) else (y, {})
        return jnp.sum(jnp.sin(y)), (y, extra)
    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


@pytest.mark.parametrize("impl,mesh_spec,layout,mode,n", [
    ("pallas", "expert=4,tensor=2", "train", "padded", 32),  # exchanged; w2's bytes split on K
    ("pallas", "expert=4,data=2", "generate", "auto", 30),   # 4 does not divide 30: replicated
    ("xla", "expert=2,fsdp=2,tensor=2", "train", "ragged_emulated", 32),
])
def test_mxfp4_expert_parallel_equals_one_device(inputs, impl, mesh_spec, layout, mode, n):
    z, idx, w, packed = (*(a[:n] for a in inputs[:3]), inputs[3])
    c = CONFIG.replace(moe_impl=impl)
    mats = [PackedMatrix(packed[j], packed[j + 1], impl) for j in (0, 2, 4)]
    want_g, (want, _) = _loss_and_grads(
        lambda z, w: experts_ragged(z, idx, w, *mats, c))(z, w)
    with use_sharding(make_mesh(mesh_spec), layout, collectives=mode) as ctx:
        fn = lambda z, w: experts_sharded(z, idx, w, *mats, c, ctx=ctx)  # noqa: E731
        exchange = {"padded": "all_to_all", "ragged_emulated": "all_gather"}.get(mode)
        traced = str(jax.make_jaxpr(fn)(z, w))
        assert (exchange in traced) if exchange else not re.search("all_to_all|all_gather",
                                                                    traced)
        got_g, (got, extra) = _loss_and_grads(fn)(z, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    assert int(extra["moe_dropped"]) == 0


def _shard_map_operands(jaxpr) -> list:
    """Operand avals of every ``shard_map`` in ``jaxpr``, nested calls included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            out += [v.aval for v in eqn.invars]
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                sub = getattr(sub, "jaxpr", sub)                    # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    out += _shard_map_operands(sub)
    return out


def test_the_moe_layer_sends_the_bytes_into_the_exchange():
    """On ``expert=4,tensor=2`` the layer's exchange takes the experts' uint8 bytes, and no
    float expert weight ``[E, De, I]`` is among its operands (traced only: the values are the
    test above's)."""
    c = CONFIG.replace(moe_impl="xla")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(c, rngs=nnx.Rngs(0))))  # abstract
    x = jax.ShapeDtypeStruct((2, 8, c.hidden_size), jnp.float32)
    layer = lambda state, x: nnx.merge(graphdef, state)(x)[0]  # noqa: E731
    with use_sharding(make_mesh("expert=4,tensor=2"), "generate"):
        operands = _shard_map_operands(jax.make_jaxpr(layer)(state, x).jaxpr)
    e, de, i = c.num_experts, c.expert_hidden_size, c.moe_intermediate_size
    assert sum(a.dtype == jnp.uint8 for a in operands) == 6, operands      # 3 x (codes, scales)
    assert not [a for a in operands if a.shape in ((e, de, i), (e, i, de))], operands


def test_the_kernel_inside_the_exchange_types_forward_and_backward_for_tpu(inputs):
    """Traced for TPU (``compile_target``: the real kernel, ``check_vma`` on), the exchange's
    loss and gradients type-check: the kernel's output says how it varies over the mesh, and
    its backward's input cotangent varies as its input (the weights vary over the experts and
    tensor axes the tokens do not). Tracing only; ``tests/test_tpu_compile.py`` compiles."""
    from kdsa.kernels_pallas.common import compile_target

    z, idx, w, packed = inputs
    mats = [PackedMatrix(packed[j], packed[j + 1], "pallas") for j in (0, 2, 4)]
    c = CONFIG.replace(moe_impl="pallas")
    with compile_target("tpu"), use_sharding(make_mesh("expert=2,tensor=2,data=2"), "train",
                                             collectives="ragged") as ctx:
        fn = lambda z, w: experts_sharded(z, idx, w, *mats, c, ctx=ctx)  # noqa: E731
        traced = str(jax.make_jaxpr(jax.grad(lambda z, w: jnp.sum(fn(z, w)[0]),
                                             argnums=(0, 1)))(z, w))
    assert traced.count("mxfp4_grouped_matmul") == 3 and "ragged_all_to_all" in traced

    # rows the same on every device against experts split over the axis: the cotangent of
    # the rows is summed over it (the kernel's backward alone would type it as varying)
    from kdsa.kernels_pallas.mxfp4_matmul import mxfp4_grouped_matmul
    from kdsa.model.mxfp4 import unpack_from_compressed_tensors

    def local(x, codes, scales):                                    # [M, De], [E/4, I, ...]
        sizes = jnp.full((codes.shape[0],), x.shape[0] // codes.shape[0], jnp.int32)
        return mxfp4_grouped_matmul(x, unpack_from_compressed_tensors(codes), scales, sizes)

    mesh = make_mesh("expert=4,data=2")
    spec = jax.sharding.PartitionSpec("expert")
    split = jax.shard_map(local, mesh=mesh, in_specs=(jax.sharding.PartitionSpec(), spec, spec),
                          out_specs=spec)
    with compile_target("tpu"):
        traced = str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(split(x, *packed[:2]))))(z))
    assert "psum" in traced
