"""The one table from logical axis names to mesh axes, per layout (``train``, ``generate``).

Parameters carry logical names in their ``axes`` metadata (glossary in ``model/layers.py``);
parameters stacked by the layer scan have one more leading dimension, named ``layers``.
Activations are constrained by logical names prefixed ``act_``. A logical name maps to a tuple
of mesh axes (sharded over their product) or ``None`` (replicated). A mesh axis already used by
an earlier dimension of the same array is skipped; when a dimension is not divisible by the
product, it takes the longest prefix of the axes that divides (replicated if none);
``replicated_report`` lists the large parameters that end up fully replicated so such
fallbacks are visible.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from kdsa.model.partitioning import Rules, logical_to_spec  # noqa: F401 (re-exported)

RULES: dict[str, Rules] = {
    # Training: FSDP over `fsdp` (weights' model dim; non-expert weights also over `expert`,
    # which outside the MoE is one more FSDP/batch axis, as in MaxText), experts over
    # `expert`, heads and FFN hidden over `tensor`, batch over data x fsdp x expert, sequence
    # over `sequence`.
    # MLA's latent dims take the FSDP axes too (q_b_proj, kv_b_proj, the indexer's wq_b have no
    # `embed` dim), so no large weight stays whole (`replicated_report`). Heads and FFN hidden
    # stay on `tensor` alone: with FSDP fallbacks there, o_proj / down_proj ([heads, embed])
    # took (tensor, expert) on their first dim, a worse layout on which XLA's SPMD partitioner
    # (JAX 0.12, CPU) also computed wrong Gated DSA outputs when no constraints were active.
    "train": {
        "embed": ("fsdp", "expert"), "vocab": ("tensor",), "mlp": ("tensor",),
        "heads": ("tensor",), "q_lora": ("fsdp", "expert"), "kv_lora": ("fsdp", "expert"),
        "index_heads": ("tensor",),
        "experts": ("expert",), "expert_embed": ("fsdp",), "expert_mlp": ("tensor",),
        "vision_embed": ("fsdp", "expert"), "vision_heads": ("tensor",),
        "vision_mlp": ("tensor",),
        "layers": None,
        "act_batch": ("data", "fsdp", "expert"), "act_seq": ("sequence",), "act_embed": None,
        "act_heads": ("tensor",), "act_vocab": ("tensor",),
    },
    # The vision tower (model/vision, ~0.45B in K3) follows the same scheme: its width FSDP-
    # sharded like `embed`, attention width and MLP hidden over `tensor`; the projector's
    # hidden is `vision_mlp`, its output `embed`.
    # Generation: no FSDP (weights stay resident), experts over `expert`, heads over `tensor`,
    # requests over data x fsdp x expert: attention is data-parallel across the expert axis
    # (DeepSeek/Kimi serving's "DP attention"), so each device caches only its own requests'
    # MLA latents (one latent per token, nothing to split over heads); the MoE sends tokens
    # to their experts' devices (all-to-all).
    "generate": {
        "embed": None, "vocab": ("tensor",), "mlp": ("tensor",), "heads": ("tensor",),
        "q_lora": None, "kv_lora": None, "index_heads": ("tensor",),
        "experts": ("expert",), "expert_embed": None, "expert_mlp": ("tensor",),
        "vision_embed": None, "vision_heads": ("tensor",), "vision_mlp": ("tensor",),
        "layers": None,
        "act_batch": ("data", "fsdp", "expert"), "act_seq": None, "act_embed": None,
        "act_heads": ("tensor",), "act_vocab": ("tensor",),
    },
}


def get_rules(layout: str) -> Rules:
    try:
        return RULES[layout]
    except KeyError:
        raise ValueError(f"unknown layout {layout!r}; choose from {sorted(RULES)}") from None


def batch_groups(mesh: Mesh, layout: str) -> tuple[tuple[str, ...], int]:
    """The mesh axes (of size > 1) that ``layout`` splits the batch over, and their product:
    the device groups that each run their own rows ("DP attention" in generation)."""
    axes = tuple(a for a in (get_rules(layout).get("act_batch") or ()) if mesh.shape.get(a, 1) > 1)
    return axes, int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))


def variable_axes(var: nnx.Variable) -> tuple[str | None, ...]:
    """Logical axes of a parameter, with ``layers`` prepended for scan-stacked ones."""
    axes = tuple(var.get_metadata().get("axes", (None,) * var.ndim))
    extra = var.ndim - len(axes)
    if extra < 0:
        raise ValueError(f"parameter of shape {var.shape} has more axis names {axes}")
    return ("layers",) * extra + axes


def state_shardings(state: nnx.State, mesh: Mesh, layout: str) -> nnx.State:
    """A NamedSharding for every variable in ``state`` (same tree structure)."""
    rules = get_rules(layout)
    return jax.tree.map(
        lambda v: NamedSharding(mesh, logical_to_spec(variable_axes(v), v.shape, mesh, rules)),
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def layout_shardings(mesh: Mesh | None, layout: str):
    """``state -> state_shardings(state, mesh, layout)``: what ``kdsa.model.checkpoint``'s
    ``load_model`` / ``target_shardings`` take to restore straight into a layout; None (one
    device) when ``mesh`` is None."""
    get_rules(layout)  # an unknown layout fails here, not at restore time
    if mesh is None:
        return None
    return lambda state: state_shardings(state, mesh, layout)


def place(x, sharding: NamedSharding) -> jax.Array:
    """``x`` on ``sharding``. For a mesh spanning several processes, ``x`` must hold the same
    value on every process (e.g. built from the same seed); each process fills only its own
    devices' shards from it (``make_array_from_callback``), nothing is exchanged."""
    if sharding.is_fully_addressable or not getattr(x, "is_fully_addressable", True):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_model(model: nnx.Module, mesh: Mesh, layout: str) -> nnx.Module:
    """Place every variable of ``model`` on ``mesh`` by the layout's rules (in place); see
    :func:`place` for meshes over several processes."""
    state = nnx.state(model)
    shardings = state_shardings(state, mesh, layout)
    nnx.update(model, jax.tree.map(
        lambda v, s: v.replace(place(v[...], s)), state, shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable)))
    return model


def build_sharded(make, mesh: Mesh, layout: str) -> nnx.Module:
    """``make()`` (builds an NNX module, e.g. a randomly initialised ``Transformer``) run as one
    compiled program whose outputs are the variables in the layout's shardings: each device
    computes only its own shards (each process only its devices') and no host ever holds the
    whole model, unlike building on the host and then :func:`shard_model`. Needs
    ``jax_threefry_partitionable`` (JAX 0.12 default): the values equal the host-built ones."""
    if not jax.config.jax_threefry_partitionable:
        raise ValueError("build_sharded needs jax_threefry_partitionable=True (random values "
                         "independent of the sharding)")
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    shardings = state_shardings(abstract, mesh, layout)
    state = jax.jit(lambda: nnx.state(make()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def replicated_report(state: nnx.State, mesh: Mesh, layout: str,
                      min_bytes: int = 1 << 20) -> list[str]:
    """Names of parameters of at least ``min_bytes`` that the layout leaves fully replicated."""
    rules = get_rules(layout)
    out = []
    for path, v in nnx.to_flat_state(state):
        nbytes = v.size * v.dtype.itemsize
        spec = logical_to_spec(variable_axes(v), v.shape, mesh, rules)
        if nbytes >= min_bytes and all(s is None for s in spec):
            out.append(f"{'/'.join(map(str, path))} {tuple(v.shape)} {nbytes / 2**20:.1f} MiB")
    return out
