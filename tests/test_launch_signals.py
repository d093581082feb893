"""``kdsa launch-local`` under a scheduler's stop signal: SIGTERM to the launcher reaches every
process of the job, which finish the same step, write one checkpoint together and exit 143;
the launcher waits for them and exits 143, leaving no process behind. The command is given
as torchrun users type it (``-- kdsa train ...``)."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from launch_env import launch_env


def _processes_marked(mark: str) -> list[int]:
    """pids whose environment holds ``KDSA_TEST_MARK=mark`` (the launcher's children)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"KDSA_TEST_MARK={mark}".encode() in (d / "environ").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def _metrics_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_sigterm_to_launch_local_checkpoints_every_process_and_exits_143(tmp_path):
    run_dir, mark = tmp_path / "run", uuid.uuid4().hex
    cmd = [sys.executable, "-m", "kdsa.cli.main", "launch-local", "--processes", "2",
           "--timeout", "400", "--", "kdsa", "train", "--preset", "tiny", "--steps", "500",
           "--run-dir", str(run_dir), "--no-progress",  # 1 KDA layer: a short compile
           "--set", "num_hidden_layers=1", "--set", "attn_res_block_size=null",
           "--set", "linear_attn_config.kda_layers=[1]",
           "--set", "linear_attn_config.full_attn_layers=[]",
           "--train-set", "batch_size=2", "--train-set", "seq_len=16",
           "--train-set", "checkpoint_every=1000"]
    env = launch_env(KDSA_TEST_MARK=mark, KDSA_SHARE_COMPILES=str(tmp_path / "jax_cache"))
    launcher = subprocess.Popen(cmd, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while len(_metrics_steps(run_dir)) < 2 and time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.2)
        assert _metrics_steps(run_dir), "the job never trained a step"
        launcher.send_signal(signal.SIGTERM)  # the launcher only, as a scheduler would
        out, err = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 143, (out[-3000:], err[-3000:])
    assert "SIGTERM: forwarded to 2 processes" in err
    stopped = [line for line in out.splitlines() if "stopped by SIGTERM after step" in line]
    assert {line.split()[0] for line in stopped} == {"[p0]", "[p1]"}, out[-3000:]
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    assert all(f"after step {step};" in line for line in stopped)  # the same step on both
    assert (run_dir / "checkpoints" / str(step)).is_dir()
    assert _metrics_steps(run_dir)[-1] == step
    assert _processes_marked(mark) == []  # nothing left running unsupervised
