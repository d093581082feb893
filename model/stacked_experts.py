"""Routed experts' weights read where they lie inside the cached layer scan (TPU).

The cached layer scan (``Transformer._run_cached_segment``, prefill and decode) gives each layer
its weights sliced out of their ``[R, ...]`` stacks. XLA:TPU fuses such a slice into a dense
matmul that reads it, but not into ``jax.lax.ragged_dot``: every MoE layer's routed experts
``[E, De, I]`` were copied out of their stack at every step (``k3-slice`` at 12 layers on
``v5e``: all of a decode step's temporaries, docs/sharding.md §9). The copy reads and writes
the layer's expert weights once more before the grouped matmul reads them, and a decode step
at small batch is bound by reading those weights.

So when compiling for TPU the scan hands each MoE layer its whole stacks, as
:class:`StackedWeight` ``(stack [R, E, ...], layer)``, and :func:`ragged_dot` multiplies by
``stack.reshape(R * E, ...)`` (a free reshape) with the layer's group sizes at groups
``[layer * E, (layer + 1) * E)`` and every other group empty: the products of
``ragged_dot(x, stack[layer], sizes)`` without the slice. The paths that take no stack (the CPU
experts, the one-hot reference, fake-quantised QAT weights, a cast to another dtype) get the
layer's own slice (:func:`own`), as before. MXFP4 weights are not kept stacked.

:class:`PackedMatrix` is the other form :func:`ragged_dot` takes: an MXFP4 expert weight's
bytes, multiplied by the grouped MXFP4 matmul (the Pallas kernel with ``moe_impl="pallas"``),
so expert-parallel ``shard_map`` bodies take packed weights the same way as float ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kdsa.kernels_pallas.mxfp4_matmul import mxfp4_grouped_matmul
from kdsa.model.moe_mxfp4 import unpack_expert_weight
from kdsa.model.mxfp4 import unpack_from_compressed_tensors
from kdsa.model.partitioning import compile_platform, current

EXPERT_WEIGHTS = ("w1", "w3", "w2")  # RoutedExperts' float weights, by attribute name


@jax.tree_util.register_pytree_node_class
class StackedWeight:
    """One layer's routed-expert weight ``[E, ...]``, held as its scan's whole ``stack``
    ``[R, E, ...]`` and the ``layer`` index there; ``shape`` and ``dtype`` are the layer's."""

    def __init__(self, stack, layer):
        self.stack, self.layer = stack, layer

    def tree_flatten(self):
        return (self.stack, self.layer), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    def __getitem__(self, index):  # ``variable[...]`` (nnx) reads the value whole
        if index is not Ellipsis:
            raise TypeError("a StackedWeight is read whole (w[...]) or through own(w)")
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype


@jax.tree_util.register_pytree_node_class
class PackedMatrix:
    """One layer's MXFP4 expert weight as stored (``kdsa.model.moe_mxfp4``): ``packed
    [E, N, K/2]`` uint8 codes and ``scale [E, N, K/32]`` E8M0 bytes, blocks of 32 along the
    contracting dim K; ``impl`` ("xla" | "pallas") picks the grouped matmul. ``shape`` is the
    float weight's ``[E, K, N]``, so code that reads ``w.shape`` takes either form."""

    def __init__(self, packed, scale, impl: str):
        self.packed, self.scale, self.impl = packed, scale, impl

    def tree_flatten(self):
        return (self.packed, self.scale), self.impl

    @classmethod
    def tree_unflatten(cls, impl, children):
        return cls(*children, impl)

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, half = self.packed.shape
        return e, 2 * half, n


def keep_stacked() -> bool:
    """Whether the cached scan hands MoE layers their expert stacks: when compiling for TPU
    (``ragged_dot`` on XLA:CPU is a masked dense product over every group, and GPU was not
    measured), unless the active layout splits the experts' ``expert_embed`` dim (the train
    layout's FSDP): the expert-parallel ``shard_map`` gathers that dim at its boundary, which
    would gather the whole stack for each layer."""
    ctx = current()
    return compile_platform() == "tpu" and (ctx is None or not ctx.axes("expert_embed"))


def is_expert_weight(path: tuple) -> bool:
    """Whether an ``nnx`` state path is a routed experts' float weight (``...experts.w1``)."""
    return len(path) >= 2 and path[-2] == "experts" and path[-1] in EXPERT_WEIGHTS


def own(w):
    """The layer's own weight: ``w``, or its slice out of a :class:`StackedWeight`."""
    if isinstance(w, StackedWeight):
        return jax.lax.dynamic_index_in_dim(w.stack, w.layer, keepdims=False)
    return w


def ragged_dot(x: jax.Array, w, group_sizes: jax.Array, dtype) -> jax.Array:
    """``jax.lax.ragged_dot(x [M, K], w.astype(dtype) [E, K, N], group_sizes [E])`` with ``w``
    an array or a :class:`StackedWeight` (read through the flat stack; module docstring), or
    a :class:`PackedMatrix`: with ``impl="pallas"`` the grouped MXFP4 kernel (float32
    accumulation; ``x`` in bfloat16 when ``dtype`` is, else float32), with ``"xla"`` the exact
    dequantisation to ``dtype`` and ``ragged_dot``, the products of the float weights. ``[M,
    N]`` in ``dtype``; rows past ``sum(group_sizes)`` are 0 either way.

    (``"xla"`` is not ``mxfp4_grouped_matmul(impl="xla")``, its reference at HIGHEST float32
    precision: inside the expert-parallel step XLA:TPU fused that dequantisation into the
    float32 grouped matmul and ran out of scoped VMEM compiling ``k3-slice`` for ``v5e``.)"""
    if isinstance(w, PackedMatrix):
        if w.impl == "xla":
            return jax.lax.ragged_dot(x, unpack_expert_weight(w.packed, w.scale, dtype),
                                      group_sizes)
        mm_dt = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32
        return mxfp4_grouped_matmul(x.astype(mm_dt), unpack_from_compressed_tensors(w.packed),
                                    w.scale, group_sizes, impl=w.impl).astype(dtype)
    if not isinstance(w, StackedWeight) or w.dtype != dtype:
        return jax.lax.ragged_dot(x, own(w).astype(dtype), group_sizes)
    r, e = w.stack.shape[:2]
    sizes = jax.lax.dynamic_update_slice(jnp.zeros((r * e,), group_sizes.dtype), group_sizes,
                                         (w.layer * e,))                           # [R * E]
    return jax.lax.ragged_dot(x, w.stack.reshape((r * e,) + w.shape[1:]), sizes)


def spec_of(w, spec):
    """A ``shard_map`` in-spec for ``w``: ``spec`` of an ``[E, ...]`` array, or the same split
    behind an unsplit repeat axis (and a replicated layer index) for a :class:`StackedWeight`;
    for a :class:`PackedMatrix` ``spec`` of ``[E, K, N]`` as the bytes' ``[E, N, K/..]``."""
    if isinstance(w, PackedMatrix):
        e, k, n = spec
        return PackedMatrix(P(e, n, k), P(e, n, k), w.impl)
    return StackedWeight(P(None, *spec), P()) if isinstance(w, StackedWeight) else spec
