"""Where the test suite's compile time goes, per program and per test file.

    python bench/bench_compile_profile.py [PYTEST ARGS ...]   # default: the whole suite

runs pytest (the README's test command, both xdist workers) with this module loaded as a
pytest plugin: every worker logs JAX's ``Finished tracing / jaxpr to MLIR / XLA compilation``
lines (logger ``jax._src.dispatch`` at DEBUG) with the test that was running into a folder, and
the totals go to ``bench/results/compile_profile.json``: XLA compile seconds and counts per
program name (``jit(prefill_step)``, ``jit(_train_step)``, ...) and per test file, lowering
and tracing seconds (nested traces count twice), and the op-by-op (eager) compiles. XLA times
include loads from the run's persistent compile cache. Subprocess tests (multi-process jobs)
are not seen. Numbers from 2026-12-06: docs/performance.md (session 26).
"""

from __future__ import annotations

import collections
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import write_results  # noqa: E402  (bench/timing.py; the script's folder)

LOG_DIR_ENV = "KDSA_COMPILE_PROFILE_DIR"
_LINE = re.compile(r"Finished (tracing|jaxpr to MLIR module conversion|XLA compilation of) "
                   r"(.*?) (?:for jit )?in ([0-9.]+) sec")
# the program names of op-by-op (eager) execution: one jax.numpy function or primitive each
EAGER_NAMES = frozenset({
    'broadcast_in_dim', 'multiply', 'convert_element_type', 'dynamic_slice', '_truncated_normal',
    '_multi_slice', 'add', 'scan', '_normal', '_uniform', 'true_divide', '_einsum', '_where',
    'reshape', 'concatenate', 'iota', '_pad', '_moveaxis', 'dot_general', 'select_n', 'sub',
    'subtract', 'exp', 'log', 'sqrt', 'negative', 'maximum', 'gather', 'scatter', '_take',
    'transpose', 'squeeze', 'expand_dims', 'reduce_sum', '_reduce_sum', 'argmax', 'cumsum', 'sort',
    '_gather', 'clamp', 'tanh', 'logistic', 'integer_pow', 'pow', 'rsqrt', 'erf_inv',
    '_threefry_split', '_threefry_fold_in', '_randint', '_shuffle', '_bernoulli', '_categorical',
    '_gumbel', 'stage', 'slice', '_unstack', 'remainder', 'floor_divide', 'abs', 'sign', 'square',
    'max', 'min', '_mean', 'mean', '_var', '_std', 'cos', 'sin', 'less', 'greater', 'equal', 'ne',
    'eq', 'lt', 'gt', 'ge', 'le', '_roll', '_searchsorted', '_isin', 'not_equal'})

# ---- the pytest plugin (loaded in every worker with ``-p bench_compile_profile``) ----
_CURRENT = ["(collection)"]


class _Handler(logging.Handler):
    def __init__(self, out):
        super().__init__(logging.DEBUG)
        self.out = out

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Finished"):
            self.out.write(f"{_CURRENT[0]}\t{message}\n")


def pytest_configure(config):
    folder = os.environ.get(LOG_DIR_ENV)
    if folder:
        out = open(Path(folder) / f"{os.getpid()}.tsv", "a", buffering=1)
        logger = logging.getLogger("jax._src.dispatch")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(_Handler(out))


def pytest_runtest_setup(item):
    _CURRENT[0] = item.nodeid


# ---- the report ----
def summarize(folder: Path) -> dict:
    per_program = collections.defaultdict(lambda: [0.0, 0])
    per_file = collections.defaultdict(lambda: {"xla_s": 0.0, "lower_s": 0.0, "trace_s": 0.0,
                                                "compiles": 0, "eager_s": 0.0})
    totals = {"xla_s": 0.0, "lower_s": 0.0, "trace_s": 0.0, "compiles": 0, "eager_s": 0.0}
    for path in folder.glob("*.tsv"):
        for line in path.read_text().splitlines():
            test, _, message = line.partition("\t")
            m = _LINE.search(message)
            if not m:
                continue
            kind, name, seconds = m.group(1), m.group(2), float(m.group(3))
            row = per_file[test.split("::")[0]]
            key = {"tracing": "trace_s", "XLA compilation of": "xla_s"}.get(kind, "lower_s")
            for target in (row, totals):
                target[key] += seconds
            if name.startswith("jit(") and name[4:-1] in EAGER_NAMES:  # (lowering and XLA)
                row["eager_s"] += seconds
                totals["eager_s"] += seconds
            if key == "xla_s":
                row["compiles"] += 1
                totals["compiles"] += 1
                per_program[name][0] += seconds
                per_program[name][1] += 1
    top = sorted(per_program.items(), key=lambda kv: -kv[1][0])[:40]
    files = sorted(per_file.items(), key=lambda kv: -(kv[1]["xla_s"] + kv[1]["lower_s"]
                                                      + kv[1]["trace_s"]))
    rnd = lambda d: {k: round(v, 1) if isinstance(v, float) else v for k, v in d.items()}  # noqa
    return {"totals": rnd(totals),
            "programs": [{"name": n, "xla_s": round(s, 1), "compiles": c} for n, (s, c) in top],
            "files": [dict(file=f, **rnd(v)) for f, v in files]}


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="kdsa-compile-profile-") as folder:
        env = dict(os.environ, **{LOG_DIR_ENV: folder},
                   PYTHONPATH=os.pathsep.join([str(root / "bench"),
                                               os.environ.get("PYTHONPATH", "")]))
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p",
                              "bench_compile_profile", *argv], cwd=root, env=env)
        result = summarize(Path(folder))
    result.update(command="python bench/bench_compile_profile.py " + " ".join(argv),
                  pytest_exit=rc, wall_s=round(time.perf_counter() - t0, 1),
                  load_average=os.getloadavg())
    out = root / "bench" / "results" / "compile_profile.json"
    write_results(out, result)
    t = result["totals"]
    print(f"{t['compiles']} XLA compiles, {t['xla_s']} s XLA, {t['lower_s']} s lowering, "
          f"{t['trace_s']} s tracing, {t['eager_s']} s op by op -> {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
