"""``kdsa launch-local``: run N local processes as one multi-host job (CPU, gloo collectives).

    kdsa launch-local --processes 2 --devices-per-process 4 -- forward --preset tiny

Each process gets ``KDSA_COORDINATOR`` / ``KDSA_NUM_PROCESSES`` / ``KDSA_PROCESS_ID`` and
``--devices-per-process`` CPU devices; its output lines are prefixed ``[pN]``. ``--module``
runs another module than the kdsa CLI (``kdsa.sharding.selfcheck``, the multi-host check).
When one process fails the others are stopped and the command exits with that process's
status (no hang).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

_GRACE_S = 5  # seconds between SIGTERM and SIGKILL for the processes still running

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
                        "(default: the kdsa CLI; e.g. kdsa.sharding.selfcheck)")
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


def run(args) -> int:
    if args.processes < 1 or args.devices_per_process < 1:
        raise ValueError("--processes and --devices-per-process must be >= 1")
    cmd = [c for c in args.cmd if c != "--"]
    if not cmd:
        raise ValueError("no command given after --")
    port = _free_port()
    procs = []
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
        threading.Thread(target=_pump, args=(proc, f"[p{pid}]"), daemon=True).start()
        procs.append(proc)
    start, status = time.monotonic(), 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, status = failed[0]
                print(f"[launch-local] process {i} exited with {status}; stopping the others",
                      file=sys.stderr)
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
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=_GRACE_S)  # JAX catches SIGTERM (preemption notice): then KILL
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    return status if status > 0 else 1
