"""``kdsa launch-local``: run N local processes as one multi-host job (CPU, gloo collectives).

    kdsa launch-local --processes 2 --devices-per-process 4 -- forward --preset tiny

Each process gets ``KDSA_COORDINATOR`` / ``KDSA_NUM_PROCESSES`` / ``KDSA_PROCESS_ID`` and
``--devices-per-process`` CPU devices; its output lines are prefixed ``[pN]``. The command may
start with the program name, as torchrun users type it (``-- kdsa train ...`` and
``-- train ...`` are the same). ``--module`` runs another module than the kdsa CLI
(the test suite's multi-host checks). When one process fails the others are
stopped and the command exits with that process's status (no hang); a process killed by a
signal (the kernel's out-of-memory killer: SIGKILL) is named as such, and the command exits
with 128 + its number, as a shell does. Every process's last lines are printed before the
command returns.

SIGTERM or Ctrl-C to the launcher (a scheduler's preemption notice) is forwarded to every
process, and the launcher waits up to ``--stop-timeout`` seconds while they finish their step,
write their checkpoint and exit (``kdsa train`` / ``kdsa rl``: 143); a second signal, or the
timeout, kills them. The launcher exits with the processes' common status (else 143).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

_GRACE_S = 5  # after a failure: seconds between SIGTERM and SIGKILL for the rest
_DRAIN_S = 5  # at the end: seconds to print what the processes wrote last
_PROGRAM_NAMES = ("kdsa", "kdsa.cli.main")

def register(sub) -> None:
    p = sub.add_parser("launch-local", help="run a kdsa command as N local processes",
                       description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, required=True, help="number of processes")
    p.add_argument("--devices-per-process", type=int, default=1,
                   help="CPU devices per process (XLA host platform device count)")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop everything after this many seconds (exit 124)")
    p.add_argument("--module", default="kdsa.cli.main",
                   help="Python module each process runs with the command's arguments "
                        "(default: the kdsa CLI)")
    p.add_argument("--stop-timeout", type=float, default=300.0,
                   help="after SIGTERM / Ctrl-C: seconds the processes get to checkpoint and "
                        "exit before they are killed (default 300)")
    p.add_argument("cmd", nargs="+", metavar="-- COMMAND",
                   help="the kdsa command and its arguments, after --")
    p.set_defaults(run=run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(proc: subprocess.Popen, prefix: str) -> None:
    for line in proc.stdout:
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()


def inner_command(args) -> list[str]:
    """The command each process runs: what follows the separating ``--`` (argparse drops it;
    a later ``--`` belongs to the command), without a leading program name ``kdsa``."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if cmd and args.module == "kdsa.cli.main" and Path(cmd[0]).name in _PROGRAM_NAMES:
        cmd = cmd[1:]  # `-- kdsa train ...`: the program name, as torchrun users type it
    if not cmd:
        raise ValueError("no command given after --")
    return cmd


def run(args) -> int:
    if args.processes < 1 or args.devices_per_process < 1:
        raise ValueError("--processes and --devices-per-process must be >= 1")
    for flag, value in (("--timeout", args.timeout), ("--stop-timeout", args.stop_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {value}")
    cmd = inner_command(args)
    port = _free_port()
    procs, pumps = [], []
    for pid in range(args.processes):
        env = dict(os.environ, KDSA_COORDINATOR=f"127.0.0.1:{port}",
                   KDSA_NUM_PROCESSES=str(args.processes), KDSA_PROCESS_ID=str(pid),
                   JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if "xla_force_host_platform_device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={args.devices_per_process}")
        env["XLA_FLAGS"] = " ".join(flags)
        proc = subprocess.Popen([sys.executable, "-m", args.module, *cmd], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        pumps.append(threading.Thread(target=_pump, args=(proc, f"[p{pid}]"), daemon=True))
        pumps[-1].start()
        procs.append(proc)
    stop = _Forwarder(procs)
    start, status = time.monotonic(), 0
    try:
        with stop:
            while True:
                codes = [p.poll() for p in procs]
                if stop.signum is not None:
                    return _wait_stopped(procs, stop, args.stop_timeout)
                failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    i, status = failed[0]
                    print(f"[launch-local] process {i} {_how(status)}; stopping the others",
                          file=sys.stderr)
                    status = 128 - status if status < 0 else status
                    break
                if all(c == 0 for c in codes):
                    return 0
                if args.timeout and time.monotonic() - start > args.timeout:
                    print(f"[launch-local] timeout after {args.timeout}s; stopping all",
                          file=sys.stderr)
                    status = 124
                    break
                time.sleep(0.1)
    finally:
        _stop_all(procs, _GRACE_S)
        _drain(pumps, _DRAIN_S)
    return status if status > 0 else 1


def _how(code: int) -> str:
    """How a process ended, from its return code (-N: killed by signal N)."""
    if code >= 0:
        return f"exited with {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " (out of memory?)" if code == -signal.SIGKILL else ""
    return f"was killed by {name}{hint}"


def _drain(pumps, timeout: float) -> None:
    """Wait up to ``timeout`` seconds in all for the output threads to print the processes'
    last lines (their pipes end when the processes have exited; a child process of theirs
    still holding a pipe open is not waited for)."""
    deadline = time.monotonic() + timeout
    for t in pumps:
        t.join(max(0.0, deadline - time.monotonic()))


class _Forwarder:
    """While entered (main thread only): SIGTERM / SIGINT to the launcher are sent on to every
    process group; a second one kills them."""

    def __init__(self, procs):
        self.procs, self.signum, self._old = procs, None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM,
                                                                     signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signum is not None:
            print(f"[launch-local] second {name}: killing the processes", file=sys.stderr)
            _signal_all(self.procs, signal.SIGKILL)
            return
        self.signum = signum
        print(f"[launch-local] {name}: forwarded to {len(self.procs)} processes; waiting for "
              f"them to checkpoint and exit ({name} again kills them)", file=sys.stderr,
              flush=True)
        _signal_all(self.procs, signum)


def _signal_all(procs, signum) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signum)
            except ProcessLookupError:
                pass


def _wait_stopped(procs, stop: _Forwarder, timeout: float) -> int:
    """After a forwarded signal: every process's exit, up to ``timeout`` seconds; the common
    status, else 128 + the signal."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    late = [i for i, p in enumerate(procs) if p.poll() is None]
    if late:
        print(f"[launch-local] processes {late} still running after {timeout:.0f}s; killed",
              file=sys.stderr)
    _stop_all(procs, 0)
    codes = {p.returncode for p in procs}
    code = codes.pop() if len(codes) == 1 and not late else 128 + stop.signum
    return 128 - code if code < 0 else code


def _stop_all(procs, grace_s: float) -> None:
    """SIGTERM to the processes still running, SIGKILL after ``grace_s`` seconds."""
    _signal_all(procs, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=grace_s)  # JAX catches SIGTERM (preemption notice): then KILL
        except subprocess.TimeoutExpired:
            _signal_all([p], signal.SIGKILL)
            p.wait()
