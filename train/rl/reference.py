"""The KL term's reference policy (``rl.kl_coef > 0``): the weights after SFT, written once to
``RUN_DIR/reference/<step>`` at the first RL step and read back by a resumed run.

It belongs to the run whose checkpoints sit beside it. A fresh run finding one (an earlier run
into the same folder stopped before its first checkpoint) sets it aside as
``reference.stale[-k]`` (renamed, not deleted) and takes its own; a resumed run past its SFT
steps with none (``kl_coef`` raised on resume) is refused, since the weights after SFT are gone
and the resumed ones would be a different anchor."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np

from kdsa.train.checkpointing import Checkpointer, aside_path


def open_reference(run_dir: Path, template_params, *, resumed: bool, past_sft: bool,
                   device=None, log) -> tuple[Checkpointer, object | None]:
    """``(checkpointer, params)``: the reference's checkpointer and its parameters when this
    run has them already (None: the loop saves them at the first RL step). ``device``: where
    one-device parameters go (None: they stay in ``template_params``' shardings)."""
    folder = Path(run_dir) / "reference"
    stale = not resumed and folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())
    if jax.process_count() > 1:  # process 0's view, before it renames: every process agrees
        from jax.experimental import multihost_utils

        stale = bool(multihost_utils.broadcast_one_to_all(np.int32(stale)))
    if stale:
        _set_aside(folder, log)
    ckpt = Checkpointer(folder, every=1, keep=1, async_save=False)
    if not ckpt.all_steps():
        ckpt.find_unfinished(log)  # an interrupted save of it: removed when it is saved
        if resumed and past_sft:
            raise ValueError(f"--resume: rl.kl_coef > 0 needs the reference policy (the weights "
                             f"after SFT) in {folder}, which this run never saved (kl_coef "
                             f"was 0); resume with rl.kl_coef=0, or start a new run")
        return ckpt, None
    got = ckpt.restore_latest(template_params, log=log)
    if got is None:
        raise ValueError(f"--resume: the reference policy in {folder} is unreadable")
    return ckpt, got[1] if device is None else jax.device_put(got[1], device)


def _set_aside(folder: Path, log) -> None:
    """Rename a stale ``reference`` folder (process 0; the others wait)."""
    if jax.process_index() == 0:
        dst = aside_path(folder, "stale")
        os.rename(folder, dst)
        log(f"rl: {folder} holds the reference policy of an earlier run without checkpoints; "
            f"moved to {dst.name}, this run saves its own")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("kdsa_reference_set_aside")
