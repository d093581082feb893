"""The training loop: data -> jitted step -> metrics, progress, checkpoints, SIGTERM, resume.

``run_training(model_config, train_config, run_dir)`` is deterministic given ``train_config.seed``:
the model is initialised from the seed, batch ``i`` is a pure function of ``(seed, i)``, and a
resumed run restores parameters, routing biases, optimizer state, step, RNG and the data
position, so on one CPU its per-step losses equal an uninterrupted run's bit for bit (tested).

Sharded (``mesh=``): the state is laid out by the ``train`` rules
(``sharding.train_state.train_state_shardings``: parameters and biases by their logical axes,
optimizer moments like their parameters; the step-0 state is computed in that layout,
``init_sharded``), each batch split over the batch axes with every
process handing over its own rows, and the step runs inside ``use_sharding(mesh, "train")``;
checkpoints are written and restored sharded (Orbax, every process its shards). On CPU the
losses equal the one-device run's to float32 rounding (``tests/test_sharded_train.py``).

SIGTERM (preemption) or Ctrl-C: the handler only sets a flag; the loop finishes the running
step, saves a checkpoint synchronously and returns with ``stopped=True`` (``kdsa train`` then
exits 143).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from kdsa.model.config import ModelConfig
from kdsa.model.transformer import Transformer, abstract_model
from kdsa.sharding.agreement import agreed, same_on_every_process
from kdsa.train.checkpointing import Checkpointer
from kdsa.train.config import TrainConfig
from kdsa.train.data import make_data
from kdsa.train.init_from import (check_export_destination, export_run, init_from_path,
                                  initial_state, resumed_origin)
from kdsa.progress import Progress
from kdsa.train.metrics import MetricsWriter, mfu
from kdsa.train.optim import make_optimizer
from kdsa.train.placement import Placement
from kdsa.train.run_dir import check_run_dir, state_bytes
from kdsa.train.step import init_state, split_model, train_step_with_options

SIGTERM_EXIT_CODE = 143  # 128 + SIGTERM


@dataclasses.dataclass
class RunResult:
    losses: dict[int, float]  # step (1-based, after the update) -> loss of that step
    final_step: int
    stopped: bool  # by SIGTERM or ``stop_at`` before train_config.steps
    resumed_from: int | None


def check_configs(config: ModelConfig, tc: TrainConfig) -> None:
    """Cross-checks of the two configs, before anything is built or compiled."""
    if config.context_limit is not None and tc.seq_len > config.context_limit:
        raise ValueError(f"train.seq_len={tc.seq_len} exceeds max_position_embeddings="
                         f"{config.context_limit} (this model encodes positions with RoPE)")
    if tc.indexer_stage != "none" and not config.use_indexer:
        raise ValueError(f"train.indexer_stage={tc.indexer_stage!r} needs a DSA indexer "
                         "(index_topk is None in the model config)")
    if config.expert_weight_format == "mxfp4" and tc.indexer_stage != "dense_warmup":
        raise ValueError("MXFP4 routed experts are frozen bytes: train with "
                         "expert_weight_format='bf16' (optionally expert_qat=true)")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Interrupted(BaseException):
    """A SIGTERM or Ctrl-C during work after the last checkpoint (``_StopFlag(interrupt=True)``):
    the work stops at once, since a resume redoes it. A ``BaseException``, as
    ``KeyboardInterrupt`` is, so the ``except Exception`` guards of the code it interrupts (the
    engine's steps, which abort their requests and go on) let it through."""


class _StopFlag:
    """Set by SIGTERM or a first Ctrl-C (SIGINT); the handlers are installed only in the main
    thread. A second Ctrl-C raises ``KeyboardInterrupt`` (quit without waiting for the save).
    ``interrupt=True`` (work after the last checkpoint) also raises :class:`Interrupted` at the
    first signal (once; not while the handlers are being restored)."""

    _SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, interrupt: bool = False):
        self.set = False
        self.signal_name: str | None = None
        self.interrupt = interrupt
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self._SIGNALS}
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.set:
            raise KeyboardInterrupt
        first = not self.set
        self.set = True
        self.signal_name = signal.Signals(signum).name
        if self.interrupt and first:
            raise Interrupted(self.signal_name)
        if signum == signal.SIGINT:
            _log("\nCtrl-C: saving a checkpoint after this step (Ctrl-C again quits without it)")

    def __exit__(self, *exc):
        self.interrupt = False
        for s, old in self._old.items():
            signal.signal(s, old)


def close_after_error(*opened) -> None:
    """Close what a run opened (``None`` skipped) after an error stopped it: a checkpoint being
    written finishes, and the metrics buffered for TensorBoard reach their file. A close that
    fails too is reported, so the caller re-raises the first error. (A second Ctrl-C's
    ``KeyboardInterrupt`` skips this: it means quit without waiting.)"""
    for thing in opened:
        if thing is None:
            continue
        try:
            thing.close()
        except Exception as e:  # noqa: BLE001  (the first error is the one to see)
            _log(f"while stopping after an error, {type(thing).__name__}.close() failed: "
                 f"{type(e).__name__}: {e}")


def stop_reason(flag: _StopFlag, stop_at: int | None, step: int, total: int) -> str | None:
    """Why a loop must checkpoint and stop after ``step`` (of ``total``): ``"SIGTERM"``,
    ``"SIGINT"``, ``"stop_at=N"``, or None to go on."""
    signalled = flag.set
    if jax.process_count() > 1:  # a job stops after the same step on every process (its
        # checkpoint is collective), whichever processes the signal reached by then
        from jax.experimental import multihost_utils
        signalled = bool(np.any(multihost_utils.process_allgather(np.int32(flag.set))))
    if signalled:
        return flag.signal_name or "SIGTERM"
    if stop_at is not None and stop_at <= step < total:
        return f"stop_at={stop_at}"
    return None


def prepare(config: ModelConfig, tc: TrainConfig):
    """``(abstract_model, graphdef, tx, build)``; ``build()`` makes the step-0 ``TrainState``.

    ``jax.eval_shape(build)`` is the restore template of a checkpoint.
    """
    abstract = abstract_model(config)  # shapes only: the seed changes no shape
    graphdef, params_meta, _ = split_model(abstract, tc)
    tx = make_optimizer(tc, params_meta)

    def build():
        return init_state(Transformer(config, rngs=nnx.Rngs(tc.seed)), tc, tx)[1]

    return abstract, graphdef, tx, build


def run_training(config: ModelConfig, tc: TrainConfig, run_dir: str | Path, *,
                 data_path: str | Path | None = None, resume: bool = False,
                 progress: bool = True, stop_at: int | None = None,
                 log=_log, mesh=None, compiler_options: dict | None = None,
                 init_from: str | Path | None = None,
                 export_experts: str | None = None) -> RunResult:
    """Train ``config`` for ``tc.steps`` optimizer steps, writing into ``run_dir``.

    ``resume``: continue from the newest readable checkpoint in ``run_dir`` (a fresh start when
    there is none). ``stop_at``: stop (with a checkpoint) after that global step, as a
    preemption would. ``mesh``: train on it with the ``train`` layout (``kdsa train --mesh``;
    ``sharding.mesh.fit_layout``); None = the first local device. ``compiler_options``: XLA
    options of the step's compile (``train_step_with_options``). ``init_from``: a kdsa model
    folder whose parameters start the run (``train/init_from.py``; ``config`` is its
    ``training_config``); a run that finishes writes ``RUN_DIR/model`` (experts in
    ``export_experts``, default: MXFP4 when ``init_from`` holds MXFP4 experts).
    """
    check_configs(config, tc)
    if mesh is not None:
        from kdsa.sharding.mesh import check_layout
        check_layout(config, dict(mesh.shape), "train", batch=tc.micro_batch_size,
                     seq=tc.seq_len)
    run_dir = Path(run_dir)
    # every host reads its own copy of the data: a failure on one stops all, and the rows
    # must be the same everywhere (each host hands over its share of one global batch)
    data = agreed(lambda: make_data(config.vocab_size, tc.batch_size, tc.seq_len, tc.seed,
                                    data_path, eos_id=config.eos_token_id,
                                    pad_id=config.pad_token_id), "the training data")
    if getattr(data, "fingerprint", None) is not None:
        same_on_every_process(data.fingerprint, "the training data")
    abstract, graphdef, tx, build = prepare(config, tc)
    template = jax.eval_shape(build)
    # writable, room for the checkpoints, a run dir if resumed: before compiling
    check_run_dir(run_dir, state_bytes(template) if jax.process_index() == 0 else 0,
                  tc.keep_checkpoints, resume=resume,
                  also=lambda: check_export_destination(run_dir, init_from))
    ckpt = Checkpointer(run_dir / "checkpoints", every=tc.checkpoint_every,
                        keep=tc.keep_checkpoints)
    place = Placement(mesh, graphdef, template, moe_capacity_factor=tc.moe_capacity_factor)
    restored = ckpt.restore_run(place.template(template), resume=resume, log=log,
                                model_config=config.to_hf_config(), train_config=tc.to_dict())
    origin = init_from_path(init_from)  # recorded in every checkpoint (orbax-to-hf reads it)
    fingerprint = getattr(data, "fingerprint", None)  # the rows the data index points into
    resumed_from = None
    if restored is not None:
        start, state, meta = restored
        restored, resumed_from = None, start  # no reference left to the host copy
        state = place.restored(state)
        if "data_index" not in meta:  # an RL run's checkpoints hold a task counter instead
            raise ValueError(f"--resume: {ckpt.directory / str(start)} is not a kdsa train "
                             f"checkpoint (no data index{'; a kdsa rl run: resume it with '
                             'kdsa rl --resume' if 'rl_config' in meta else ''}); use another "
                             f"--run-dir")
        data_index = int(meta["data_index"])
        if start > tc.steps:
            raise ValueError(f"--resume: checkpoint {ckpt.directory / str(start)} is past "
                             f"--steps {tc.steps}; give at least --steps {start}")
        if None not in (fingerprint, meta.get("data")) and meta["data"] != fingerprint:
            raise ValueError(f"--resume: {ckpt.directory / str(start)} was trained on other "
                             f"data ({meta['data']}; now {fingerprint}): its data index would "
                             f"point into other rows. Resume with the same data (the same "
                             f"file, tokenized the same way), or use another --run-dir")
        origin = resumed_origin(meta.get("init_from"), origin, log)
        log(f"resumed from step {start} ({ckpt.directory / str(start)})")
    else:
        # committed to the device(s) like a restored state, so both share one compiled step
        if init_from is not None:  # published weights, restored into the train layout
            start, data_index = 0, 0
            state = initial_state(init_from, config, tc, tx, shardings=place.shardings,
                                  mesh=mesh)
            log(f"initialised from {init_from}")
        else:
            start, state, data_index = 0, place.initial(build, compiler_options), 0

    from kdsa.model.count import count_params
    active = count_params(config).matmul_params  # MFU's 6 N (model/count.py)
    # drops the lines of steps > start: a fresh run (start 0) those of an earlier run into this
    # folder that stopped before its first checkpoint
    writer = MetricsWriter(run_dir, resume_step=start)
    layout = abstract.segment_layout
    losses: dict[int, float] = {}
    stopped = False
    bar = Progress(tc.steps, initial=start, enabled=progress)
    step = start
    devices = place.size  # the update's devices (one without a mesh, whatever the host has)
    step_fn = train_step_with_options(tuple(sorted((compiler_options or {}).items())),
                                      donate=True)  # one train state in memory, not two
    try:
        with _StopFlag() as flag, place.rules():
            while step < tc.steps:
                batch = data.batch(data_index)
                processed = batch["inputs"].size  # positions computed, loss tokens or not
                t0 = time.perf_counter()
                batch = place.batch(batch)  # on a mesh each process hands over its own rows
                state, m = step_fn(graphdef, state, batch, tc=tc, tx=tx, layout=layout)
                m = {k: float(v) for k, v in jax.device_get(m).items()}
                dt = time.perf_counter() - t0
                step, data_index = step + 1, data_index + 1
                m.update(step_time_s=dt, tokens_per_s=processed / dt,
                         mfu=mfu(active, processed, dt, tc.peak_flops, devices))
                losses[step] = m["loss"]
                writer.write(step, m)
                _show_step(bar, step, m)
                meta = {"data_index": data_index, "train_config": tc.to_dict(),
                        "model_config": config.to_hf_config(), "init_from": origin,
                        "data": fingerprint}
                why = stop_reason(flag, stop_at, step, tc.steps)
                if why:
                    ckpt.save(step, state, meta, force=True)
                    ckpt.wait()
                    log(f"\nstopped by {why} after step {step}; checkpoint saved in "
                        f"{ckpt.directory / str(step)}")
                    stopped = True
                    break
                ckpt.save(step, state, meta, force=step == tc.steps)
            # the last save is written while the stop flag still holds the signals: a SIGTERM
            # or Ctrl-C now waits for it (the default handlers killed it mid-write); the
            # export is left to --resume, as a stop before the end would leave it
            ckpt.wait()
            late = None if stopped else stop_reason(flag, None, step, tc.steps)
            if late:
                log(f"\n{late} while the last checkpoint was written; it is complete in "
                    f"{ckpt.directory / str(step)}; --resume writes RUN_DIR/model")
                stopped = True
    except Exception:  # the checkpoint in flight finishes, the metrics reach their files
        close_after_error(ckpt, writer, bar)
        raise
    ckpt.close()
    writer.close()
    bar.close()
    if not stopped:
        export_run(run_dir, config, graphdef, state, step=step, init_from=origin,
                   export_experts=export_experts, log=log)
    return RunResult(losses=losses, final_step=step, stopped=stopped,
                     resumed_from=resumed_from)


def _show_step(bar: Progress, step: int, m: dict) -> None:
    """A training run's bar: step, loss, tokens/s, learning rate."""
    bar.advance_to(step, loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:,.0f}",
                   lr=f"{m['learning_rate']:.2e}")
