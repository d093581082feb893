"""Multi-process start-up and failure handling (``kdsa launch-local``, CPU, gloo collectives).

Two bounded subprocess runs: a process whose peer never comes gets the clear ``JoinError``
within its timeout; when one process fails, launch-local stops the others and exits non-zero.
The 2-process x 2-device numerics (training with expert and sequence parallelism across
processes, the cross-process reshard train -> generate -> train, generation) are checked
against one device by one launch in ``tests/test_sharded_train.py``
(``test_two_process_job_train_reshard_generate_equals_one_device``), which replaced the
separate launches that were here and there (two of them gated by ``KDSA_SLOW_TESTS``).
"""

import socket
import subprocess
import sys
import time

import pytest

from launch_env import launch_env


def _launch(*args, timeout):
    cmd = [sys.executable, "-m", "kdsa.cli.main", "launch-local", *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def test_missing_peer_gives_a_clear_join_error_within_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = launch_env(KDSA_COORDINATOR=f"127.0.0.1:{port}", KDSA_NUM_PROCESSES="2",
                     KDSA_PROCESS_ID="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "selfcheck", "--timeout", "3"],
                          env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-2000:]  # an error, not an abort (134)
    assert "process 1 of 2 could not join the job at coordinator" in proc.stderr
    assert "a peer is missing or unreachable" in proc.stderr
    assert elapsed < 45


def test_launch_local_stops_the_others_when_one_process_fails():
    proc, elapsed = _launch("--processes", "2", "--devices-per-process", "1", "--timeout", "60",
                            "--module", "selfcheck", "--", "--fail-process", "1",
                            timeout=90)
    assert proc.returncode == 3  # the failing process's status
    assert "process 1 failing on purpose" in proc.stdout
    assert "process 1 exited with 3; stopping the others" in proc.stderr
    assert "selfcheck: process 0 of 2" not in proc.stdout  # process 0 never finished
    assert elapsed < 45


def test_a_process_killed_by_a_signal_is_named_and_the_job_exits_128_plus_it(tmp_path):
    """Process 1 killed by SIGKILL (what the out-of-memory killer sends): the launcher names the
    signal (it printed "exited with -9"), exits 137 as a shell would (it exited 1), and prints
    the last line process 1 wrote before it was killed."""
    (tmp_path / "dies.py").write_text(
        "import os, signal, time\n"
        "me = os.environ['KDSA_PROCESS_ID']\n"
        "for i in range(5000):\n"
        "    print(f'p{me} line {i}')\n"  # more than a pipe holds
        "print(f'p{me} last line', flush=True)\n"
        "if me == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n")
    cmd = [sys.executable, "-m", "kdsa.cli.main", "launch-local", "--processes", "2",
           "--timeout", "60", "--module", "dies", "--", "x"]
    proc = subprocess.run(cmd, env=launch_env(PYTHONPATH=str(tmp_path)), capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == 128 + 9, (proc.returncode, proc.stderr[-2000:])
    assert "process 1 was killed by SIGKILL (out of memory?); stopping the others" in proc.stderr
    assert "[p1] p1 last line" in proc.stdout  # (process 0 may be stopped before its own)


def test_jobcheck_steps_and_the_cross_process_count():
    """``jobcheck``'s step splitting, and its count of moves whose shards change process
    (the 2-process test asserts most arrays do): fake devices of 2 processes x 2."""
    from jobcheck import _crosses_processes, split_steps

    assert split_steps(["train", "--x", "1", "+", "generate"]) == [["train", "--x", "1"],
                                                                   ["generate"]]
    with pytest.raises(ValueError, match="empty step"):
        split_steps(["train", "+"])

    class Dev:
        def __init__(self, i):
            self.id, self.process_index = i, i // 2

    class Sharding:
        def __init__(self, rows):  # device -> (start, stop) of the 4 rows
            self.rows = rows

        def devices_indices_map(self, shape):
            return {d: (slice(*r), slice(None)) for d, r in self.rows.items()}

    d = [Dev(i) for i in range(4)]
    src = Sharding({d[0]: (0, 2), d[1]: (0, 2), d[2]: (2, 4), d[3]: (2, 4)})
    finer = Sharding({d[0]: (0, 1), d[1]: (1, 2), d[2]: (2, 3), d[3]: (3, 4)})
    reversed_ = Sharding({d[3]: (0, 2), d[2]: (0, 2), d[1]: (2, 4), d[0]: (2, 4)})
    replicated = Sharding({x: (0, 4) for x in d})
    assert not _crosses_processes(src, finer, (4, 3))  # every piece already in its process
    assert _crosses_processes(src, reversed_, (4, 3))
    assert _crosses_processes(src, replicated, (4, 3))  # each process needs the other's half
    assert not _crosses_processes(replicated, src, (4, 3))


@pytest.mark.parametrize("version,processes,off", [("0.12.1", 2, True), ("0.12.2rc1", 2, True),
                                                   ("0.12.0.1", 2, False), ("0.12.1", 1, False)])
def test_every_process_compiles_for_itself_where_jax_deadlocks(monkeypatch, capsys, version,
                                                               processes, off):
    """JAX 0.12.1 on CPU deadlocks a multi-process program one process loaded (from the
    persistent cache or a peer) against the copy its peer compiled (docs/sharding.md, section
    7): after joining such a job, ``distributed`` turns the persistent cache off and ignores
    ``KDSA_SHARE_COMPILES``; a single process, or JAX 0.12.0, keeps both."""
    import jax

    from kdsa.sharding import distributed

    monkeypatch.setattr(jax, "__version__", version)
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    monkeypatch.setenv(distributed.ENV_SHARE_COMPILES, "/nonexistent")
    before = jax.config.jax_enable_compilation_cache
    try:
        jax.config.update("jax_enable_compilation_cache", True)
        assert distributed._compile_in_every_process() == off
        assert jax.config.jax_enable_compilation_cache == (not off)
        assert ("KDSA_SHARE_COMPILES ignored" in capsys.readouterr().err) == off
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
