"""Activation sharding by logical name, active only inside ``use_sharding(mesh, layout)``.

``model/`` stays mesh-agnostic: it calls ``constrain(x, ("act_batch", "act_seq", "act_embed"))``
at block boundaries, and the sharded implementations in ``expert_parallel.py`` and
``context_parallel.py`` ask :func:`current` whether a mesh axis is active. Outside the context
manager both are no-ops, so single-device code and tests are unchanged.

The context is a ``jax.make_user_context`` value, which is part of ``jax.jit``'s cache key:
a function traced without rules is retraced (not reused) when called under rules, and two
layouts on the same mesh get two traces. Constraints are ``with_sharding_constraint`` to a
``NamedSharding`` on an ``Auto`` mesh (``mesh.py``): they pin GSPMD's choice at the boundary and
leave the partitioner free inside (MaxText ``maybe_shard_with_logical``, ``maxtext.md`` 3).

Usage::

    mesh = make_mesh("expert=4,tensor=2")
    shard_model(model, mesh, "train")
    with use_sharding(mesh, "train"):
        loss, grads = train_step(model, batch)      # nnx.jit-ed; traced under the rules
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kdsa.sharding.rules import get_rules, logical_to_spec

COLLECTIVES = ("auto", "padded", "ragged", "ragged_emulated")


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
    rules: tuple[tuple[str, tuple[str, ...] | None], ...]
    moe_capacity_factor: float | None = None
    collectives: str = "auto"

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

    def ep_collectives(self) -> str:
        """The EP exchange to use: ``padded``, ``ragged`` or ``ragged_emulated``."""
        if self.collectives != "auto":
            return self.collectives
        platform = self.mesh.devices.flat[0].platform
        return "padded" if platform == "cpu" else "ragged"


_CONTEXT = jax.make_user_context(None)


@contextlib.contextmanager
def use_sharding(mesh: Mesh, layout: str, *, moe_capacity_factor: float | None = None,
                 collectives: str = "auto") -> Iterator[ShardingContext]:
    """Activate ``layout``'s rules on ``mesh`` for everything traced inside the block."""
    if collectives not in COLLECTIVES:
        raise ValueError(f"collectives must be one of {COLLECTIVES}, got {collectives!r}")
    if moe_capacity_factor is not None and not moe_capacity_factor > 0:
        raise ValueError(f"moe_capacity_factor must be > 0 or None (dropless), got "
                         f"{moe_capacity_factor}")
    rules = tuple(sorted((k, None if v is None else tuple(v))
                         for k, v in get_rules(layout).items()))
    ctx = ShardingContext(mesh=mesh, layout=layout, rules=rules,
                          moe_capacity_factor=moe_capacity_factor, collectives=collectives)
    with _CONTEXT(ctx):
        yield ctx


def current() -> ShardingContext | None:
    """The active context, or None (single device / no rules)."""
    return _CONTEXT.value


def constrain(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
    """``with_sharding_constraint`` of ``x`` to the active rules' spec for ``logical``; no-op
    without an active context."""
    ctx = current()
    if ctx is None:
        return x
    if len(logical) != x.ndim:
        raise ValueError(f"constrain: logical axes {logical} do not match shape {x.shape}")
    return jax.lax.with_sharding_constraint(x, ctx.sharding(logical, x.shape))
