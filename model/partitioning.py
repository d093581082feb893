"""The model's one sharding interface: logical-axis constraints, active only inside a context.

``model/`` stays mesh-agnostic. It names array dimensions logically (``("act_batch",
"act_seq", "act_embed")``; glossary in ``layers.py``) and calls :func:`constrain` at block
boundaries; the sequence- and expert-parallel forms (``sequence_parallel.py``,
``expert_parallel.py``) ask :func:`current` whether a mesh axis is active. Outside a context
both are no-ops, so single-device code and tests are unchanged.

What the names map to is not decided here: ``kdsa.sharding`` owns the rules table per layout
and activates it (``sharding.constrain.use_sharding(mesh, layout)`` builds a
:class:`ShardingContext` and enters :func:`activate`). The dependency points one way:
``sharding`` imports the model, never the reverse.

The context is a ``jax.make_user_context`` value, which is part of ``jax.jit``'s cache key: a
function traced without rules is retraced (not reused) when called under rules, and two
layouts on the same mesh get two traces. Constraints are ``with_sharding_constraint`` to a
``NamedSharding``: they pin the partitioner's choice at the boundary and leave it free inside
(MaxText's ``maybe_shard_with_logical`` does the same).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kdsa.kernels_pallas.common import backend as kernel_backend

Rules = Mapping[str, tuple[str, ...] | None]  # logical name -> mesh axes (None: replicated)
COLLECTIVES = ("auto", "padded", "ragged", "ragged_emulated")


def logical_to_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
                    rules: Rules) -> P:
    """PartitionSpec for an array of ``shape`` whose dims have logical names ``axes``.

    A mesh axis already used by an earlier dimension is skipped; a dimension not divisible by
    its axes' product takes the longest prefix that divides (replicated if none)."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    used: set[str] = set()
    spec = []
    for name, dim in zip(axes, shape):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        mesh_axes = tuple(a for a in (rules[name] or ()) if a not in used
                          and mesh.shape.get(a, 1) > 1)
        while mesh_axes and dim % math.prod(mesh.shape[a] for a in mesh_axes):
            mesh_axes = mesh_axes[:-1]  # the longest prefix that divides
        if not mesh_axes:
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(spec_entry(mesh_axes))
    return P(*spec)


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry (``None``, a name or a tuple of names)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: tuple[str, ...]):
    """A ``PartitionSpec`` entry for ``axes``: ``None``, one name or the tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


@dataclasses.dataclass(frozen=True)
class ShardingContext:
    """The active mesh, the layout's rules, and the sharded-implementation options.

    ``moe_capacity_factor``: expert-parallel buffers hold ``ceil(cf * assignments / ep)`` rows
    per (source, destination) pair (padded) or ``ceil(cf * assignments)`` rows per receiver
    (ragged); ``None`` sizes them for the worst case, so nothing can overflow (dropless).
    ``collectives``: EP token exchange; ``auto`` = ``ragged_all_to_all`` on GPU/TPU, padded
    ``all_to_all`` on CPU (XLA:CPU has no ragged all-to-all); ``ragged_emulated`` runs the ragged
    algorithm with an all-gather stand-in for the collective (CPU tests of the offsets).
    """

    mesh: Mesh
    layout: str
    rules: tuple[tuple[str, tuple[str, ...] | None], ...]  # sorted items (hashable)
    moe_capacity_factor: float | None = None
    collectives: str = "auto"

    def __post_init__(self):
        if self.collectives not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {COLLECTIVES}, got "
                             f"{self.collectives!r}")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise ValueError(f"moe_capacity_factor must be > 0 or None (dropless), got "
                             f"{self.moe_capacity_factor}")

    @property
    def rules_dict(self) -> dict[str, tuple[str, ...] | None]:
        return dict(self.rules)

    def axes(self, logical: str) -> tuple[str, ...]:
        """Mesh axes (of size > 1) that the logical name maps to."""
        rule = self.rules_dict.get(logical) or ()
        return tuple(a for a in rule if self.mesh.shape.get(a, 1) > 1)

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    def spec(self, logical: tuple[str | None, ...], shape: tuple[int, ...]) -> P:
        return logical_to_spec(tuple(logical), tuple(shape), self.mesh, self.rules_dict)

    def sharding(self, logical: tuple[str | None, ...], shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape))

    @property
    def platform(self) -> str:
        """``"cpu" | "gpu" | "tpu"``: the mesh's devices (abstract TPU devices when compiling
        for a TPU topology on a CPU host)."""
        platform = self.mesh.devices.flat[0].platform
        return "gpu" if platform in ("cuda", "rocm") else platform

    def ep_collectives(self) -> str:
        """The EP exchange to use: ``padded``, ``ragged`` or ``ragged_emulated``."""
        if self.collectives != "auto":
            return self.collectives
        return "padded" if self.platform == "cpu" else "ragged"


_CONTEXT = jax.make_user_context(None)


@contextlib.contextmanager
def activate(ctx: ShardingContext) -> Iterator[ShardingContext]:
    """Make ``ctx`` the active context for everything traced inside the block."""
    with _CONTEXT(ctx):
        yield ctx


@contextlib.contextmanager
def without_sharding() -> Iterator[None]:
    """No active context inside the block (the per-device body of a ``shard_map``)."""
    with _CONTEXT(None):
        yield


def current() -> ShardingContext | None:
    """The active context, or None (single device / no rules)."""
    return _CONTEXT.value


def compile_platform() -> str:
    """``"cpu" | "gpu" | "tpu"``: the platform of the active mesh's devices (ahead-of-time TPU
    compiles on a CPU host trace under a mesh of TPU devices), else the kernels' backend
    (``kernels_pallas.common.backend()``, which follows ``compile_target``)."""
    ctx = current()
    return kernel_backend() if ctx is None else ctx.platform


def constrain(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
    """``with_sharding_constraint`` of ``x`` to the active rules' spec for ``logical``; no-op
    without an active context."""
    ctx = current()
    if ctx is None:
        return x
    if len(logical) != x.ndim:
        raise ValueError(f"constrain: logical axes {logical} do not match shape {x.shape}")
    return jax.lax.with_sharding_constraint(x, ctx.sharding(logical, x.shape))
