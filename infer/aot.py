"""The engine's generate steps compiled for a named TPU topology on this host (no TPU needed).

``generate_step_compiles(config, topology, sizes, slots=S, max_len=L, prefill_chunk=C)``
gives, for each of the runner's own two programs (``infer/runner_steps.py``), a function that
compiles it under the ``generate`` layout with XLA:TPU (libtpu), from sharded
``ShapeDtypeStruct``s (nothing is allocated; the abstract model is built once for both):

* ``prefill``: one chunk of ``C`` tokens of one request into its slot of the dense-slot cache
  (``[repeats, S, L, ...]``, slots over the layout's batch axes), with the chunk's last logits;
* ``decode``: one token for every slot at once.

With ``paged=True`` both run on the paged cache the server uses by default (``slots x
pages_for(L)`` pages in one partition per batch device group, ``model/paged_attention.py``)
with their block tables. ``sizes=None``: the topology's first device alone, without a mesh,
as the runner runs on one TPU (its cache placed by ``infer/cache_layout.py`` all the same).

Both donate the cache, as the runner does. The result is XLA's per-device memory of each
program (``sharding/aot.py``), which ``kdsa plan --compile --layout generate`` prints beside
the planner's estimate.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from kdsa.infer.cache_layout import TPU_LANES, cache_shardings, row_major
from kdsa.infer.runner_steps import decode_step, prefill_step
from kdsa.model.config import ModelConfig
from kdsa.sharding.aot import CompiledMemory, compiled_memory, topology_devices


def generate_step_compiles(config: ModelConfig, topology: str, sizes: dict[str, int] | None, *,
                           slots: int, max_len: int, prefill_chunk: int, paged: bool = False
                           ) -> dict[str, Callable[[], CompiledMemory]]:
    """``{"prefill": f, "decode": f}``, each ``f()`` compiling its step (module docstring); the
    caller decides what a refused compile means (``kdsa plan``: that step does not fit)."""
    import contextlib

    from jax.sharding import NamedSharding, PartitionSpec as P, make_single_device_sharding

    from kdsa.kernels_pallas.common import compile_target
    from kdsa.model.transformer import abstract_model
    from kdsa.sharding.constrain import use_sharding
    from kdsa.sharding.mesh import check_layout, make_mesh
    from kdsa.model.paged_cache import pages_for
    from kdsa.sharding.rules import batch_groups, state_shardings

    if not 1 <= prefill_chunk <= max_len:
        raise ValueError(f"prefill chunk {prefill_chunk} must be in [1, --seq {max_len}]")
    devices = topology_devices(topology)
    model = abstract_model(config)
    graphdef, state = nnx.split(model)
    if sizes is None:  # one device, no mesh
        mesh, parts, rep = None, 1, make_single_device_sharding(devices[0])
        state = _sharded(state, rep)
    else:
        check_layout(config, sizes, "generate")
        mesh = make_mesh(sizes, devices=devices)
        parts, rep = batch_groups(mesh, "generate")[1], NamedSharding(mesh, P())
        state = _sharded(state, state_shardings(state, mesh, "generate"))
    pages = pages_for(max_len)
    if paged:
        cache = jax.eval_shape(lambda: model.init_paged_cache(
            slots, slots * pages, pages, parts, TPU_LANES).layers)
    else:
        cache = jax.eval_shape(lambda: model.init_cache(slots, max_len, TPU_LANES))
    cache = row_major(cache)                             # (the runner's cache: the DSA
    cache_sh = cache_shardings(cache, mesh, "generate",  # buffers row-major as Formats)
                               devices[0])
    cache = _sharded(cache, cache_sh)
    arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
    i32, scalar = jnp.int32, ()
    tables = ((None, None, arg((pages,), i32)), (arg((slots, pages), i32),)) if paged else ((), ())
    steps = {
        "prefill": (prefill_step, (arg(scalar, i32), arg((1, prefill_chunk), i32),
                                    arg(scalar, i32), arg(scalar, i32), arg(scalar, jnp.bool_))
                    + tables[0]),
        "decode": (decode_step, (arg((slots,), i32), arg((slots,), i32),
                                  arg((slots,), jnp.bool_)) + tables[1]),
    }

    def compile_step(fn, args) -> CompiledMemory:
        t0 = time.perf_counter()
        rules = contextlib.nullcontext() if mesh is None else use_sharding(mesh, "generate")
        with compile_target("tpu"), rules:
            compiled = jax.jit(functools.partial(fn, graphdef), donate_argnums=(1,),
                               out_shardings=(rep, cache_sh)).lower(state, cache, *args).compile()
        return compiled_memory(compiled, time.perf_counter() - t0)

    return {name: functools.partial(compile_step, fn, args) for name, (fn, args) in steps.items()}


def _sharded(tree, shardings):
    """``tree``'s leaves as ``ShapeDtypeStruct``s with ``shardings`` (a prefix of ``tree``: one
    sharding per array, or per ``nnx.Variable`` of a model state)."""
    return jax.tree.map(lambda s, sub: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), sub), shardings, tree)
