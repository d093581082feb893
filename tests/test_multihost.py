"""Multi-process start-up and failure handling (``kdsa launch-local``, CPU, gloo collectives).

Two bounded subprocess runs: a process whose peer never comes gets the clear ``JoinError``
within its timeout; when one process fails, launch-local stops the others and exits non-zero.
The 2-process x 2-device numerics (sharded forward, gradients, optimizer steps with expert and
sequence parallelism across processes) are checked against one device by
``tests/test_sharded_train.py::test_two_process_training_equals_one_process``, which replaced
the forward-only ``selfcheck`` comparison that was here (one multi-process compile instead of
two).
"""

import os
import socket
import subprocess
import sys
import time


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # launch-local sets the device count per process
    for k in ("KDSA_COORDINATOR", "KDSA_NUM_PROCESSES", "KDSA_PROCESS_ID"):
        env.pop(k, None)
    return env


def _launch(*args, timeout):
    cmd = [sys.executable, "-m", "kdsa.cli.main", "launch-local", *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def test_missing_peer_gives_a_clear_join_error_within_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(_env(), KDSA_COORDINATOR=f"127.0.0.1:{port}", KDSA_NUM_PROCESSES="2",
               KDSA_PROCESS_ID="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kdsa.sharding.selfcheck", "--timeout", "3"],
                          env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-2000:]  # an error, not an abort (134)
    assert "process 1 of 2 could not join the job at coordinator" in proc.stderr
    assert "a peer is missing or unreachable" in proc.stderr
    assert elapsed < 45


def test_launch_local_stops_the_others_when_one_process_fails():
    proc, elapsed = _launch("--processes", "2", "--devices-per-process", "1", "--timeout", "60",
                            "--module", "kdsa.sharding.selfcheck", "--", "--fail-process", "1",
                            timeout=90)
    assert proc.returncode == 3  # the failing process's status
    assert "process 1 failing on purpose" in proc.stdout
    assert "process 1 exited with 3; stopping the others" in proc.stderr
    assert "selfcheck: process 0 of 2" not in proc.stdout  # process 0 never finished
    assert elapsed < 45
