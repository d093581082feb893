"""The real training step compiled for a named TPU topology on this host (no TPU needed).

``compile_train_step(config, tc, topology, sizes)`` builds the mesh over the abstract devices
of ``jax.experimental.topologies.get_topology_desc(topology)``, the train state and a batch as
sharded ``ShapeDtypeStruct``s (nothing is allocated), and compiles ``train_step`` (loss,
gradients, optimizer update, the configured remat, routing-bias update) under the ``train``
layout with XLA:TPU (libtpu). The result is XLA's per-device memory of that program, which
``kdsa plan --compile`` prints beside the planner's estimate.

Per-device peak = arguments + outputs - aliased + temporaries (+ code): ``train_step`` does not
donate its input state, so the state is counted twice (old and new) unless XLA aliases it.

HBM per chip (per TensorCore device, as ``jax.devices()`` sees it), from the public chip specs:
v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp

from kdsa.model.config import ModelConfig
from kdsa.train.config import TrainConfig

GiB = 1 << 30
CHIP_HBM = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5litepod": 16 * GiB, "v5p": 95 * GiB,
            "v6e": 32 * GiB}


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's per-device bytes of one compiled program, and its compile time."""
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    code: int
    compile_seconds: float

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "peak": self.peak}


def chip_hbm(topology: str) -> int | None:
    """HBM bytes per device of a topology name such as ``v5p:8x8x16`` (None: unknown chip)."""
    return CHIP_HBM.get(topology.split(":", 1)[0].split("-", 1)[0])


def topology_devices(topology: str) -> list:
    """The abstract devices of ``topology`` (``v5e:2x2``, ``v5p:8x8x16``, ...); a clear error
    without libtpu."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        import libtpu  # noqa: F401 - only whether it imports
    except ImportError:
        raise ValueError("--compile needs libtpu (the XLA:TPU compiler): pip install libtpu, "
                         "or the test extra (pip install -e '.[test]')") from None
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(topology, platform="tpu").devices)
    except Exception as e:  # noqa: BLE001 - libtpu's message names the problem
        raise ValueError(f"--topology {topology}: {str(e).splitlines()[0]}") from None


def compile_train_step(config: ModelConfig, tc: TrainConfig, topology: str,
                       sizes: dict[str, int], *, batch: int, seq: int,
                       moe_capacity_factor: float | None = None) -> CompiledMemory:
    """Compile one optimizer step of ``batch`` sequences of ``seq`` tokens for ``topology``
    on a mesh of ``sizes`` (the ``train`` layout); see the module docstring."""
    from kdsa.kernels_pallas.common import compile_target
    from kdsa.sharding.constrain import use_sharding
    from kdsa.sharding.mesh import make_mesh
    from kdsa.sharding.train_state import (batch_sharding, sharded_template,
                                           train_state_shardings)
    from kdsa.train.step import train_step
    from kdsa.train.trainer import prepare

    devices = topology_devices(topology)
    mesh = make_mesh(sizes, devices=devices)
    tc = tc.replace(batch_size=batch, seq_len=seq)
    abstract, graphdef, tx, build = prepare(config, tc)
    template = jax.eval_shape(build)
    state = sharded_template(template, train_state_shardings(graphdef, template, mesh, "train"))
    shapes = {"inputs": ((batch, seq), jnp.int32), "targets": ((batch, seq), jnp.int32),
              "loss_mask": ((batch, seq), jnp.float32)}
    data = {k: jax.ShapeDtypeStruct(s, d, sharding=batch_sharding(mesh, "train", s))
            for k, (s, d) in shapes.items()}
    t0 = time.perf_counter()
    with compile_target("tpu"), use_sharding(mesh, "train",
                                             moe_capacity_factor=moe_capacity_factor):
        compiled = train_step.lower(graphdef, state, data, tc=tc, tx=tx,
                                    layout=abstract.segment_layout).compile()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    return CompiledMemory(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
                          aliased=m.alias_size_in_bytes, temporaries=m.temp_size_in_bytes,
                          code=m.generated_code_size_in_bytes,
                          compile_seconds=round(seconds, 1))
