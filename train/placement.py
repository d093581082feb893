"""The placement of a training run's state and batches (``kdsa train`` and ``kdsa rl`` alike)."""

from __future__ import annotations

import contextlib

import jax


class Placement:
    """Where a training update runs: the first local device (``mesh=None``) or the ``train``
    layout on ``mesh`` (data, fsdp, expert, tensor, sequence; every process's devices in a
    multi-process job): the state sharded by the rules (``sharding/train_state.py``), the
    step-0 state computed in its layout, batches split over the batch axes with each process
    handing over its own rows, the step traced under ``use_sharding``."""

    def __init__(self, mesh, graphdef, template, *, moe_capacity_factor: float | None = None):
        self.mesh, self.graphdef = mesh, graphdef
        self.moe_capacity_factor = moe_capacity_factor
        if mesh is None:
            self.device, self.shardings = jax.local_devices()[0], None
            return
        from kdsa.sharding.train_state import train_state_shardings
        self.shardings = train_state_shardings(graphdef, template, mesh, "train")

    @property
    def size(self) -> int:
        """Devices the update runs on (``update_devices`` in metrics.jsonl)."""
        return 1 if self.mesh is None else self.mesh.size

    @property
    def collective(self) -> bool:
        """Checkpoints are written by every process together (the state spans them)."""
        return self.mesh is not None and jax.process_count() > 1

    def template(self, template):
        """A restore target: the abstract state with the layout's shardings attached."""
        if self.mesh is None:
            return template
        from kdsa.sharding.train_state import sharded_template
        return sharded_template(template, self.shardings)

    def initial(self, build, compiler_options=None):
        """The step-0 state where the update runs: on one device, built on the host and put
        there; on a mesh, computed directly in its layout (``init_sharded``: every device only
        its own shards, no host holds the whole tree)."""
        if self.mesh is None:
            return jax.device_put(build(), self.device)
        from kdsa.sharding.train_state import init_sharded
        return init_sharded(build, self.shardings, compiler_options)

    def restored(self, state):
        """A restored state where the update runs: on one device it is read as host arrays and
        put there, committed like the step-0 state (uncommitted inputs would compile the step a
        second time: XLA is then free to choose their placement); on a mesh it is read in the
        layout already."""
        return jax.device_put(state, self.device) if self.mesh is None else state

    def batch(self, batch: dict) -> dict:
        """Host batch (the same on every process) -> rows over the batch axes."""
        if self.mesh is None:
            return batch
        from kdsa.sharding.train_state import place_batch
        return place_batch(batch, self.mesh, "train")

    def rules(self):
        """The context the update is traced in (the train rules), or a no-op."""
        if self.mesh is None:
            return contextlib.nullcontext()
        from kdsa.sharding.constrain import use_sharding
        return use_sharding(self.mesh, "train", moe_capacity_factor=self.moe_capacity_factor)
