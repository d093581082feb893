"""Per-step metrics: ``metrics.jsonl`` and a TensorBoard event file, no TensorFlow needed.

``metrics.jsonl``: one JSON object per step (``step``, ``loss``, ``grad_norm``,
``learning_rate``, ``tokens``, ``tokens_per_s``, ``mfu`` when a peak is given,
``expert_load_max_over_mean``, ``indexer_kl``, ``step_time_s``). Written by process 0 only.
A run passes ``resume_step``, the step it starts from (0 for a fresh one): the lines of later
steps, written before an interruption (or by an earlier run into the same folder that stopped
before its first checkpoint) and about to be written again, are dropped first (the file is
rewritten atomically: temporary file, then rename), as is a torn last line; so every step
appears once.

TensorBoard: ``events.out.tfevents.*`` in the run dir holds the same numbers as scalar
summaries (tags ``train/<name>``), written by ``tensorboardX`` (a maintained writer without
TensorFlow). A resumed run opens its writer with ``purge_step = resume_step + 1``: the file
starts with a ``SessionLog`` START event at that step, TensorBoard's signal to drop the older
files' events from there on, so a redone step shows once.

``tokens`` counts the step's loss tokens; ``tokens_per_s`` and the MFU count every position the
step computes (``batch_size * seq_len``: prompts, padding and document boundaries included),
as throughput benchmarks do (until 2026-12-07 both counted loss tokens, which understated a
chat SFT run's by the share of its answers).

MFU estimate: ``6 * active_params * tokens / step_time / (peak_flops * devices)``, the usual
dense-equivalent count (forward 2, backward 4 FLOPs per active parameter per token; attention
score FLOPs are not counted), with ``active_params`` from ``kdsa.model.count``.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import jax


class MetricsWriter:
    """Appends per-step metrics to ``run_dir/metrics.jsonl`` and a TensorBoard event file.

    ``resume_step``: the step a resumed run restarts from; lines of later steps are dropped
    (:func:`truncate_metrics`) and TensorBoard is told to drop them too.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True,
                 resume_step: int | None = None):
        self.enabled = jax.process_index() == 0
        self.run_dir = Path(run_dir)
        self._jsonl = self._tb = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        if resume_step is not None:
            truncate_metrics(path, resume_step)
        self._jsonl = open(path, "a")
        if tensorboard:
            from tensorboardX import SummaryWriter

            # a file of its own even when a run resumes within the same second
            self._tb = SummaryWriter(str(self.run_dir), flush_secs=10,
                                     filename_suffix=f".{time.time_ns()}",
                                     purge_step=None if resume_step is None else resume_step + 1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        rec = {"step": int(step), **{k: _num(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(rec) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            now = time.time()
            for k, v in rec.items():
                if k != "step" and v is not None and math.isfinite(v):
                    self._tb.add_scalar(f"train/{k}", v, int(step), walltime=now)

    def close(self) -> None:
        for f in (self._jsonl, self._tb):
            if f is not None:
                f.close()


def truncate_metrics(path: str | Path, last_step: int) -> int:
    """Keep only the lines of ``path`` (a ``metrics.jsonl``) whose step is at most
    ``last_step`` (dropping lines that do not parse, e.g. one torn by a crash); the file is
    replaced atomically. Returns the number of lines dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            ok = int(json.loads(line)["step"]) <= last_step
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok:
            keep.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return dropped


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (every step a run and its resumptions logged), skipping
    a line a crash tore."""
    rows = []
    for line in Path(path).read_text().splitlines() if Path(path).is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)]


def _num(v) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def mfu(active_params: int, tokens: float, seconds: float, peak_flops: float,
        devices: int = 1) -> float:
    """Model FLOP utilisation estimate (see module docstring); 0 when no peak is given."""
    if peak_flops <= 0 or seconds <= 0:
        return 0.0
    return 6.0 * active_params * tokens / seconds / (peak_flops * devices)
