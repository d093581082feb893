"""Where the runner's decode cache lives: each leaf's sharding on a mesh, the Gated DSA
buffers' row-major layout on TPU, and the RoPE keys' lane width.

``cache_shardings(cache, mesh, layout)`` is what ``ModelRunner`` allocates its cache with and
what its steps return it with (``infer/aot.py`` compiles with the same); ``None`` where the
default placement serves (one CPU or GPU device). ``row_major(cache)`` marks a dense-slot cache
so placed: its layers read their stacks in place (``model/sequence_parallel.py : _in_stack``).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, make_single_device_sharding

from kdsa.model.dsa_cache import DSACache
from kdsa.model.paged_cache import BUFFERS

TPU_LANES = 128


def rope_lanes_for(mesh, device=None) -> int | None:
    """The runner's RoPE-key cache columns (``model/dsa_layer.py : rope_cache_width``): 128
    lanes when the cache lives on TPUs (the mesh's devices, else ``device``, else this
    process's first), else the key's own width (None)."""
    first = mesh.devices.flat[0] if mesh is not None else device or jax.local_devices()[0]
    return TPU_LANES if first.platform == "tpu" else None


def cache_shardings(cache, mesh, layout: str, device=None):
    """Every cache leaf ``[repeats, slots, ...]`` with slots over the layout's ``act_batch``
    axes ("DP attention": each device caches its own requests); a paged pool's rows
    ``[repeats, R, D]`` the same way (its partitions). A KDA layer's recurrent state
    ``[repeats, slots, H, K, V]`` and conv window ``[repeats, slots, W-1, 3, H*K]`` also have
    their heads split as the layout splits ``act_heads``, as the step computes them: replicated
    over ``tensor``, the new states were all-gathered at the end of every step to match (K3 on
    ``v5p:4x8x8``: three 264 MiB all-gathers per decode step and device for the recurrent
    states).

    The Gated DSA layers' buffers (``kv_latent``, ``k_rope``, ``index_keys``) are placed
    row-major (a ``Format``; CPU's default layout anyway). XLA:TPU's default for a buffer
    narrower than 128 lanes (a small model's latent, a 64-wide RoPE key) keeps the rows minor,
    which neither the Pallas kernels' row DMAs nor a layer's read of its stack as rows can
    use: each step then copied those buffers to row-major and back (docs/sharding.md, section
    9). On TPU the RoPE keys also take 128 columns (``TPU_LANES``), which XLA keeps row-major
    through the whole step.

    Without a mesh: on one TPU device (``device``, else this process's first) every leaf
    lives there and the DSA buffers are row-major for the same reason (the paged decode step of
    a 2-layer model copied its pools four times per step without); elsewhere None (the
    default placement, row-major already). Row-major rows narrower than 128 lanes are padded
    to 128 in HBM (``dsa_cache.dsa_cache_bytes_per_token`` counts them so)."""
    from jax.experimental.layout import Format, Layout

    if mesh is None:
        device = device or jax.local_devices()[0]
        if not places_one_device(device):
            return None
    else:
        from kdsa.sharding.rules import get_rules, logical_to_spec
        rules = get_rules(layout)

    def place(path, a):
        name = getattr(path[-1], "name", None)
        if mesh is None:
            s = make_single_device_sharding(device)
        else:
            if name == "recurrent_state":                    # [R, slots, H, K, V]
                axes = (None, "act_batch", "act_heads", None, None)
            elif name == "conv_state":                       # [R, slots, W-1, 3, H*K]
                axes = (None, "act_batch", None, None, "act_heads")
            else:
                axes = (None, "act_batch") + (None,) * (a.ndim - 2)
            s = NamedSharding(mesh, logical_to_spec(axes, a.shape, mesh, rules))
        if name not in BUFFERS:
            return s
        return Format(Layout(major_to_minor=tuple(range(a.ndim))), s)

    return jax.tree_util.tree_map_with_path(place, cache)


def places_one_device(device) -> bool:
    """Whether a cache on ``device`` alone is placed by :func:`cache_shardings` (TPU) rather
    than left to the default placement."""
    return device.platform == "tpu"


def row_major(cache):
    """``cache`` with its dense-slot DSA caches marked as placed row-major
    (``DSACache.rows_major``; :func:`cache_shardings`)."""
    is_dsa = lambda x: isinstance(x, DSACache)  # noqa: E731
    return jax.tree.map(lambda x: x.replace(rows_major=True) if is_dsa(x) else x, cache,
                        is_leaf=is_dsa)
