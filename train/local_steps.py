"""The step manager of ``Checkpointer(process_local=True)`` (``train/checkpointing.py``): one
process alone, no barriers with the job's other processes, on Orbax's v1 free functions."""

from __future__ import annotations

import shutil
from pathlib import Path

from orbax.checkpoint.experimental import v1 as ocp


class LocalSteps:
    """``process_local``'s step manager: the calls :class:`~kdsa.train.checkpointing.Checkpointer` makes of Orbax's v1
    ``training.Checkpointer``, on v1's ``save_checkpointables_async`` / ``load_checkpointables``
    into ``directory/<step>`` (Orbax's temporary directory and atomic rename; a step is a folder
    named by its number holding ``_CHECKPOINT_METADATA``). Orbax's training ``Checkpointer``
    cannot do this: it always creates its root directory through a v0 ``CheckpointManager``,
    which raises ``NotImplementedError`` with ``active_processes`` set. Pruning is the same
    ``LatestN``: after each save completes, the oldest saves beyond ``keep`` are removed (in save
    order after the steps found on disk, as Orbax orders them)."""

    def __init__(self, directory: Path, keep: int, context: ocp.Context):
        self.directory, self.keep, self.context = directory, keep, context
        directory.mkdir(parents=True, exist_ok=True)
        self._saving = None
        self.reload()

    @property
    def checkpoints(self) -> list[ocp.training.CheckpointMetadata]:
        return [ocp.training.CheckpointMetadata(s, path=self.directory / str(s), metadata=None)
                for s in sorted(self._order)]

    def reload(self) -> None:
        self._order = sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit()
                             and (p / "_CHECKPOINT_METADATA").is_file())

    def save_checkpointables_async(self, step: int, checkpointables: dict, *, force: bool):
        self.wait()
        with self.context:
            self._saving = ocp.save_checkpointables_async(self.directory / str(step),
                                                          checkpointables)
        self._order.append(step)
        return self._saving

    def wait(self) -> None:
        saving, self._saving = self._saving, None
        if saving is None:
            return
        try:
            saving.result()
        except BaseException:
            self.reload()  # the failed step is not listed
            raise
        for step in self._order[:-self.keep]:
            shutil.rmtree(self.directory / str(step), ignore_errors=True)
        self._order = self._order[-self.keep:]

    def load_checkpointables(self, step: int, abstract: dict) -> dict:
        with self.context:
            return ocp.load_checkpointables(self.directory / str(step), abstract)

    def close(self) -> None:
        self.wait()
