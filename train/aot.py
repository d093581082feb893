"""The real training step compiled for a named TPU topology on this host (no TPU needed).

``compile_train_step(config, tc, topology, sizes)`` builds the mesh over the abstract devices
of ``jax.experimental.topologies.get_topology_desc(topology)``, the train state and a batch as
sharded ``ShapeDtypeStruct``s (nothing is allocated), and compiles ``train_step`` (loss,
gradients, optimizer update, the configured remat, routing-bias update) under the ``train``
layout with XLA:TPU (libtpu). The result is XLA's per-device memory of that program, which
``kdsa plan --compile`` prints beside the planner's estimate.

Per-device peak = arguments + outputs - aliased + temporaries (+ code). The step is the one
``kdsa train`` runs, which donates its input state: the new state is written into the old one's
buffers (``aliased``), so the state counts once.

The topologies, the chips' HBM and the memory record are shared with the generate steps'
compiles (``infer/aot.py``): ``sharding/aot.py``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from kdsa.model.config import ModelConfig
from kdsa.train.config import TrainConfig

from kdsa.sharding.aot import (CHIP_HBM, CompiledMemory, chip_hbm,  # noqa: F401 - re-exported
                               compiled_memory, topology_devices)


def compile_train_step(config: ModelConfig, tc: TrainConfig, topology: str,
                       sizes: dict[str, int], *, batch: int, seq: int,
                       moe_capacity_factor: float | None = None) -> CompiledMemory:
    """Compile one optimizer step of ``batch`` sequences of ``seq`` tokens for ``topology``
    on a mesh of ``sizes`` (the ``train`` layout); see the module docstring."""
    from kdsa.kernels_pallas.common import compile_target
    from kdsa.sharding.constrain import use_sharding
    from kdsa.sharding.mesh import make_mesh
    from kdsa.train.step import train_step_with_options

    mesh = make_mesh(sizes, devices=topology_devices(topology))
    args, static = abstract_train_step_args(config, tc.replace(batch_size=batch, seq_len=seq),
                                            mesh)
    t0 = time.perf_counter()
    with compile_target("tpu"), use_sharding(mesh, "train",
                                             moe_capacity_factor=moe_capacity_factor):
        compiled = train_step_with_options(donate=True).lower(*args, **static).compile()
    return compiled_memory(compiled, time.perf_counter() - t0)


def abstract_train_step_args(config: ModelConfig, tc: TrainConfig, mesh):
    """``(args, static)`` of ``train_step(*args, **static)`` for one ``tc.batch_size x
    tc.seq_len`` batch on ``mesh``'s ``train`` layout: the graph, the train state and the
    batch as sharded ``ShapeDtypeStruct``s (nothing allocated), and the static arguments."""
    from kdsa.sharding.train_state import (batch_sharding, sharded_template,
                                           train_state_shardings)
    from kdsa.train.trainer import prepare

    abstract, graphdef, tx, build = prepare(config, tc)
    template = jax.eval_shape(build)
    state = sharded_template(template, train_state_shardings(graphdef, template, mesh, "train"))
    shape = (tc.batch_size, tc.seq_len)
    data = {k: jax.ShapeDtypeStruct(shape, d, sharding=batch_sharding(mesh, "train", shape))
            for k, d in (("inputs", jnp.int32), ("targets", jnp.int32),
                         ("loss_mask", jnp.float32))}
    return (graphdef, state, data), dict(tc=tc, tx=tx, layout=abstract.segment_layout)
