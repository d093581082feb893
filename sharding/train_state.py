"""Shardings of a training state and of its data batches, from the rules table.

A ``TrainState`` (``train/step.py``) holds pure trees: ``params`` (the trainable variables),
``rest`` (the other variables, incl. routing biases), ``opt_state`` (optax), ``step`` and
``rng``. Pure trees have lost the variables' logical axes; the graphdef kept them, so
``nnx.merge(graphdef, params, rest)`` gives them back and :func:`train_state_shardings` maps

* every model variable by the layout's rules (``rules.state_shardings``);
* every optimizer leaf like the parameter it mirrors: the longest suffix of its tree path
  that is a parameter path with the same shape (AdamW's ``mu``/``nu``, Muon's momentum);
  anything else (counts, scalars) replicated;
* ``step`` and ``rng`` replicated.

It works on arrays, ``ShapeDtypeStruct`` trees (restore templates) and tracers (the step pins
its output state with it, so the state keeps one layout from step to step).

The step-0 state is computed in that layout (:func:`init_sharded`): the initialiser is traced
abstractly and compiled with the state's shardings as outputs, so every device computes only
its own shards of the parameters and optimizer moments and no host ever holds the whole tree
(K3's 2.78T parameters: about 17 TB at 2 bytes of weight plus 4 of bfloat16 AdamW moments
each, ``sharding/plan.py``).
``jax_threefry_partitionable`` (on by default in JAX 0.12) makes the random values independent
of the sharding: the result equals the one-device initialiser's (bit for bit, except for
parameters computed through transcendental functions, where XLA's fused ``exp``/``log`` may
round in the last bit: KDA's ``dt_bias``, 1 ulp; ``tests/test_sharded_train.py``).

Batches ``[B, T]`` are split by ``("act_batch", "act_seq")``; in a multi-process job each
process passes only the shards its devices hold (``jax.make_array_from_callback``), see
:func:`place_batch`.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kdsa.sharding.rules import get_rules, logical_to_spec, state_shardings

BATCH_AXES = ("act_batch", "act_seq")


def _path(path) -> tuple[str, ...]:
    """A pytree key path as the names of its entries (``jax.tree_util.keystr`` of each), the
    form of an ``nnx`` state path: ``(.params, ['segments'], [0]) -> ('params', 'segments',
    '0')``."""
    return tuple(jax.tree_util.keystr((k,), simple=True) for k in path)


def _pure_shardings(pure, by_path: dict[tuple[str, ...], NamedSharding], what: str):
    def one(path, leaf):
        key = _path(path)
        if key not in by_path:
            raise ValueError(f"{what}: no model variable at {'/'.join(key)}")
        return by_path[key]

    return jax.tree_util.tree_map_with_path(one, pure)


def train_state_shardings(graphdef, state, mesh: Mesh, layout: str = "train"):
    """A ``TrainState`` of ``NamedSharding`` leaves for ``state`` (same structure)."""
    model = nnx.merge(graphdef, state.params, state.rest)
    by_path = {tuple(map(str, p)): s for p, s in nnx.to_flat_state(
        state_shardings(nnx.state(model), mesh, layout))}
    shapes = {tuple(map(str, p)): tuple(v.shape) for p, v in nnx.to_flat_state(
        nnx.state(model))}
    replicated = NamedSharding(mesh, P())

    def opt_leaf(path, leaf):
        key = _path(path)
        for i in range(len(key)):
            if key[i:] in by_path and shapes[key[i:]] == tuple(np.shape(leaf)):
                return by_path[key[i:]]
        return replicated

    return type(state)(
        params=_pure_shardings(state.params, by_path, "params"),
        rest=_pure_shardings(state.rest, by_path, "rest"),
        opt_state=jax.tree_util.tree_map_with_path(opt_leaf, state.opt_state),
        step=replicated, rng=replicated)


def sharded_template(template, shardings):
    """``template`` (``ShapeDtypeStruct`` or array leaves) with ``shardings`` attached: the
    restore target of a sharded checkpoint and the output spec of :func:`init_sharded`."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        template, shardings)


def init_sharded(build, shardings, compiler_options: dict | None = None):
    """``build()`` (a pure function making the step-0 state from a seed) run as one compiled
    program with ``out_shardings=shardings``: each device computes and holds only its own
    shards (in a multi-process job, each process only its devices'); nothing is built on a
    host and then placed. It runs once, so XLA's backend optimizations are off by default
    (``INIT_COMPILER_OPTIONS``: the tiny preset's init compiles in 3 s instead of 10 s on
    XLA:CPU and runs in 0.03 s; ``compiler_options`` may override it)."""
    if not jax.config.jax_threefry_partitionable:
        raise ValueError("init_sharded needs jax_threefry_partitionable=True (random values "
                         "independent of the sharding, equal to a one-device init)")
    fn = jax.jit(build, out_shardings=shardings)
    return fn.lower().compile({**INIT_COMPILER_OPTIONS, **(compiler_options or {})})()


INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def batch_sharding(mesh: Mesh, layout: str, shape: tuple[int, ...]) -> NamedSharding:
    """``[B, T, ...]`` data split by ``act_batch`` x ``act_seq`` (a dim that does not divide
    takes the longest prefix of its axes that does, as for weights)."""
    axes = BATCH_AXES[:len(shape)] + (None,) * max(0, len(shape) - 2)
    return NamedSharding(mesh, logical_to_spec(axes, tuple(shape), mesh, get_rules(layout)))


def place_batch(batch: dict, mesh: Mesh, layout: str = "train") -> dict:
    """Host arrays (the same global batch on every process) -> global arrays split by
    :func:`batch_sharding`; each process hands over only the shards its devices hold, whatever
    the mesh's device order (on TPU ``create_device_mesh`` orders devices by their place in the
    torus, and a process's rows need not be one contiguous block: ``v5p:4x4x4`` with
    ``expert=16,fsdp=-1`` gives process 0 rows 0, 1, 4 and 5)."""
    out = {}
    for name, x in batch.items():
        x = np.asarray(x)
        sharding = batch_sharding(mesh, layout, x.shape)
        if sharding.is_fully_addressable:
            out[name] = jax.device_put(x, sharding)
            continue
        out[name] = jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[index])
    return out
