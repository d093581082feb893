"""Checkpoints: bit-exact resume, corrupted-latest fallback, SIGTERM mid-run then resume."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
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


def test_sigterm_then_resume(tmp_path):
    """``kdsa train`` in a subprocess: SIGTERM after the first checkpoint, then --resume."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    args = [sys.executable, "-m", "kdsa.cli.main", "train", "--preset", "tiny",
            "--set", "num_hidden_layers=2", "--set", "attn_res_block_size=null",
            "--set", "linear_attn_config.kda_layers=[1]",
            "--set", "linear_attn_config.full_attn_layers=[2]",
            "--steps", "400", "--seed", "1", "--run-dir", str(run_dir), "--no-progress",
            "--train-set", "batch_size=2", "--train-set", "seq_len=8",
            "--train-set", "checkpoint_every=2", "--train-set", "warmup_steps=1"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.time() + 240
        while not (run_dir / "checkpoints" / "2").is_dir():
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "no checkpoint within 240 s"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in err
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text()
             .splitlines()]
    stopped_at = steps[-1]
    assert steps == list(range(1, stopped_at + 1)) and stopped_at < 400
    assert (run_dir / "checkpoints" / str(stopped_at)).is_dir()
    resume = [a if a != "400" else str(stopped_at + 2) for a in args] + ["--resume"]
    done = subprocess.run(resume, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"resumed from step {stopped_at}" in done.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text()
             .splitlines()]
    assert steps == list(range(1, stopped_at + 3))
    assert np.isfinite(json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
                       ["loss"])
