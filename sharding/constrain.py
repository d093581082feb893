"""Activate a layout's rules on a mesh for everything traced inside a block.

The model names its dimensions logically and constrains them through
``kdsa.model.partitioning`` (a no-op outside a context); this module supplies the context:
the layout's rules from ``rules.py`` on a mesh, with the expert-parallel options.

Usage::

    mesh = make_mesh("expert=4,tensor=2")
    shard_model(model, mesh, "train")
    with use_sharding(mesh, "train"):
        loss, grads = train_step(model, batch)      # nnx.jit-ed; traced under the rules
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jax.sharding import Mesh

from kdsa.model.partitioning import ShardingContext, activate
from kdsa.sharding.rules import get_rules


@contextlib.contextmanager
def use_sharding(mesh: Mesh, layout: str, *, moe_capacity_factor: float | None = None,
                 collectives: str = "auto") -> Iterator[ShardingContext]:
    """Activate ``layout``'s rules on ``mesh`` (see ``ShardingContext`` for the options)."""
    rules = tuple(sorted((k, None if v is None else tuple(v))
                         for k, v in get_rules(layout).items()))
    ctx = ShardingContext(mesh=mesh, layout=layout, rules=rules,
                          moe_capacity_factor=moe_capacity_factor, collectives=collectives)
    with activate(ctx):
        yield ctx
