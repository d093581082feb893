"""The ``kdsa`` command: a dispatcher, no logic. ``kdsa COMMAND --help`` documents each command."""

from __future__ import annotations

import argparse
import os
import sys

from kdsa.cli import forward_cmd, launch_local, params_cmd, plan_cmd
from kdsa.cli import convert_cmd
from kdsa.cli import generate_cmd, quant_check_cmd, rl_cmd, serve_cmd, train_cmd
from kdsa.sharding.distributed import JoinError, initialize


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kdsa", description="kdsa: Kimi K3 successor (KDA + Gated DSA MoE) in JAX")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in (params_cmd, forward_cmd, launch_local, plan_cmd):
        mod.register(sub)
    convert_cmd.register(sub)
    for mod in (generate_cmd, serve_cmd, quant_check_cmd, train_cmd, rl_cmd):
        mod.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command != "launch-local":
            initialize()  # joins a multi-process job when one is configured; else nothing
        return int(args.run(args) or 0)
    except (ValueError, JoinError) as e:  # config and input errors: one clear line, non-zero exit
        if os.environ.get("KDSA_DEBUG") == "1":  # the traceback, for a bug behind the line
            raise
        print(f"kdsa {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, read-only folder, port in use, ...: the OS's own words
        print(f"kdsa {args.command}: error: {_os_error(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C (the first one saves, train/trainer.py)
        print(f"kdsa {args.command}: interrupted", file=sys.stderr)
        return 130


def _os_error(e: OSError) -> str:
    """``[Errno 28] No space left on device: 'run/x'`` -> ``run/x: No space left on device``."""
    what = e.strerror or str(e)
    where = e.filename if e.filename is not None else None
    return f"{where}: {what}" if where is not None else what


if __name__ == "__main__":
    sys.exit(main())
