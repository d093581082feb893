"""Checkpoints: bit-exact resume, corrupted-latest fallback, SIGTERM mid-run then resume."""

import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from kdsa.model.config import get_preset
from kdsa.train.checkpointing import Checkpointer
from kdsa.train.config import TrainConfig
from kdsa.train.trainer import prepare, run_training

TC = TrainConfig(steps=6, batch_size=4, seq_len=16, accum_steps=2, warmup_steps=2,
                 checkpoint_every=3, keep_checkpoints=3, learning_rate=1e-2, seed=3)


def small_config():
    cfg = get_preset("tiny")
    lac = dataclasses.replace(cfg.linear_attn_config, kda_layers=(1,), full_attn_layers=(2,))
    return cfg.replace(num_hidden_layers=2, attn_res_block_size=None, linear_attn_config=lac)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    return run_dir, run_training(small_config(), TC, run_dir, progress=False)


def test_resume_is_bit_exact(full_run, tmp_path):
    _, full = full_run
    assert sorted(full.losses) == [1, 2, 3, 4, 5, 6] and not full.stopped
    first = run_training(small_config(), TC, tmp_path, progress=False, stop_at=3)
    assert first.stopped and first.final_step == 3
    rest = run_training(small_config(), TC, tmp_path, progress=False, resume=True)
    assert rest.resumed_from == 3 and rest.final_step == 6
    for step in (1, 2, 3):
        assert first.losses[step] == full.losses[step]
    for step in (4, 5, 6):
        assert rest.losses[step] == full.losses[step], (step, rest.losses, full.losses)
    assert full.losses[6] != full.losses[3]  # the losses do change from step to step
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(k in rows[0] for k in ("loss", "grad_norm", "learning_rate", "tokens_per_s",
                                      "expert_load_max_over_mean", "indexer_kl"))
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_corrupted_latest_falls_back(full_run, tmp_path):
    run_dir, _ = full_run
    import shutil

    shutil.copytree(run_dir / "checkpoints", tmp_path / "checkpoints")
    ckpt = Checkpointer(tmp_path / "checkpoints", every=3, keep=3)
    assert ckpt.all_steps() == [3, 6]
    data_files = [p for p in (tmp_path / "checkpoints" / "6" / "state").rglob("*")
                  if p.is_file() and p.parent.name == "d" and p.stat().st_size > 1000]
    assert data_files
    for p in data_files:  # garble the array bytes of the newest checkpoint
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2:] = bytes(len(raw) - len(raw) // 2)
        p.write_bytes(bytes(raw))
    messages = []
    template = jax.eval_shape(prepare(small_config(), TC)[3])
    step, state, meta = ckpt.restore_latest(template, log=messages.append)
    ckpt.close()
    assert step == 3 and meta["data_index"] == 3
    assert any("step 6" in m and "falling back to step 3" in m for m in messages), messages
    assert int(state.step) == 3


def _sigterm_after(metrics: Path, lines: int) -> threading.Thread:
    """A thread that sends this process SIGTERM once ``metrics`` has ``lines`` lines."""

    def watch():
        deadline = time.time() + 1800
        while time.time() < deadline:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= lines:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_sigterm_then_resume(tmp_path):
    """A real SIGTERM mid-run (sent to this process, as a scheduler would): the running step
    finishes, a checkpoint is saved, the run reports ``stopped``; ``--resume`` continues from it,
    and a second SIGTERM stops it again. In-process so the compiled step is shared (a subprocess
    pays interpreter start, model build and compile twice: minutes on a loaded 2-core machine);
    the CLI's exit code 143 for a stopped run is checked in ``test_cli_exit_code_after_sigterm``.
    """
    tc = TC.replace(steps=60, checkpoint_every=50, keep_checkpoints=2)
    metrics = tmp_path / "metrics.jsonl"
    messages = []
    watcher = _sigterm_after(metrics, 2)
    first = run_training(small_config(), tc, tmp_path, progress=False, log=messages.append)
    watcher.join(timeout=5)
    stopped_at = first.final_step
    assert first.stopped and 2 <= stopped_at < 60, first
    assert any("stopped by SIGTERM" in m for m in messages), messages
    assert (tmp_path / "checkpoints" / str(stopped_at)).is_dir()  # saved although every=50

    watcher = _sigterm_after(metrics, stopped_at + 1)
    rest = run_training(small_config(), tc, tmp_path, progress=False, resume=True,
                        log=messages.append)
    watcher.join(timeout=5)
    assert rest.resumed_from == stopped_at and rest.stopped and rest.final_step < 60
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, rest.final_step + 1))
    assert all(np.isfinite(rest.losses[s]) for s in rest.losses)


def test_cli_exit_code_after_sigterm(tmp_path, monkeypatch):
    """``kdsa train`` exits 143 (128 + SIGTERM) when the run was stopped by the signal."""
    from kdsa.cli.main import main
    from kdsa.train import trainer

    def stopped_run(config, tc, run_dir, **kw):
        return trainer.RunResult(losses={1: 1.0}, final_step=1, stopped=True, resumed_from=None)

    monkeypatch.setattr(trainer, "run_training", stopped_run)
    rc = main(["train", "--preset", "tiny", "--run-dir", str(tmp_path), "--steps", "30",
               "--no-progress"])
    assert rc == trainer.SIGTERM_EXIT_CODE == 143
