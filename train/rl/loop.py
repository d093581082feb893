"""The RL job: SFT warm-up (optional), then rollouts -> rewards -> advantages -> update.

``run_rl(model_config, train_config, rl_config, run_dir)`` per RL step:

1. weight sync: the train state's parameters and biases are resharded from the ``train``
   layout onto the generate mesh (``sharding/reshard.py``, ``generate`` layout; timed:
   ``sync_seconds``) and handed to the engine's runner (same shapes and shardings every step,
   so nothing recompiles);
2. rollouts: ``prompts_per_step`` tasks drawn from the weighted environment mix, an effort level
   each, ``group_size`` episodes per task on the engine (``rollout.py``); rewards with the
   budget and length terms; dynamic sampling keeps groups whose rewards vary, drawing another
   round (up to ``max_sampling_rounds``) to fill the batch; unfilled rows are padding;
3. the update (``train/rl/step.py``) with the policy loss chosen by ``rl.loss``: one jitted
   optimizer step, or ``rl.minibatches_per_step`` of them on slices of the rollout batch with
   the log-probs of the policy before the first (PPO / GRPO mini-batches); on one device, or
   on the ``train`` layout of ``mesh`` (FSDP / EP / TP / sequence, ``kdsa rl --mesh``; the
   same placement as ``kdsa train``, ``train/placement.py``).

Steps are numbered globally: ``1..sft_steps`` are SFT steps on demonstrations (``sft.py``,
metrics in ``RUN_DIR/sft/metrics.jsonl``), the next ``rl.steps`` are RL steps
(``RUN_DIR/metrics.jsonl``, one line per step). Held-out reward (fixed held-out tasks, sampled
at the rollout temperature) is measured after the warm-up and at the end. Checkpoints
(``train/checkpointing.py``) every ``checkpoint_every`` steps, at the end and on SIGTERM hold
the train state and, in the metadata, the task counter, the held-out reward before RL and the
configs; ``resume`` continues from the newest readable one. ``rl.routing_replay``: the engine
records the experts every MoE layer used for every token it ran, and the update trains each
token with those experts (``Transformer.forward(replay=RoutingReplay(...))``; the gate weights
still come from the current router); ``routing_replay_agreement`` logs how often the training
router would have chosen the same experts.

Multi-host (the same command on every process, e.g. under ``kdsa launch-local``): each process
plays its share of every step's groups on its own engine and the episodes are exchanged; the
update runs on the train layout over every process's devices, each process holding only its
shards (``multihost.py``); process 0 alone writes metrics, every process its checkpoint
shards. With ``rl.kl_coef > 0`` the weights after SFT are the reference policy,
saved once in ``RUN_DIR/reference`` (and restored on resume). Every random draw is a function of
``(seed, step)``, so a resumed run takes the same steps as an uninterrupted one (with partial
rollouts, except for the paused episodes, which are not checkpointed).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from kdsa.model.config import ModelConfig
from kdsa.model.outputs import layers_of
from kdsa.sharding.mesh import check_layout, fit_layout
from kdsa.sharding.reshard import local_gather_problem
from kdsa.train.checkpointing import Checkpointer
from kdsa.train.config import TrainConfig
from kdsa.train.init_from import (check_export_destination, export_run, init_from_path,
                                  initial_state, resumed_origin, tokenizer_folder)
from kdsa.progress import Progress
from kdsa.train.metrics import MetricsWriter
from kdsa.train.placement import Placement
from kdsa.train.rl import rollout as ro
from kdsa.train.rl.config import RLConfig
from kdsa.train.rl.multihost import local_copy, play_split
from kdsa.train.rl.preflight import build_envs, check_rl_configs
from kdsa.train.rl.reference import open_reference
from kdsa.train.rl.sampler import Sampler, evaluate
from kdsa.train.rl.sft import sft_batch
from kdsa.train.rl.step import minibatch_updates, rl_step_with_options, split_rows
from kdsa.train.run_dir import check_run_dir, state_bytes
from kdsa.train.trainer import Interrupted, _StopFlag, close_after_error, prepare, stop_reason


@dataclasses.dataclass
class RLResult:
    rewards: dict[int, float]  # RL step -> mean rollout reward
    metrics: dict[int, dict]  # RL step -> the metrics line
    heldout_before: float | None
    heldout_after: float | None
    heldout_before_by_domain: dict[str, float] | None  # same, per environment
    heldout_after_by_domain: dict[str, float] | None
    final_step: int  # global (SFT + RL) steps done
    stopped: bool
    resumed_from: int | None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_rl(config: ModelConfig, tc: TrainConfig, rc: RLConfig, run_dir: str | Path, *,
           mesh=None, resume: bool = False, progress: bool = True, stop_at: int | None = None,
           evaluate_heldout: bool = True, sampler: "Sampler | None" = None,
           compiler_options: dict | None = None, log=_log,
           init_from: str | Path | None = None, export_experts: str | None = None
           ) -> RLResult:
    """Run the job (see the module docstring). ``mesh``: run the update on it with the
    ``train`` layout (``kdsa rl --mesh``; ``sharding.mesh.fit_layout``); None = one device,
    or in a multi-process job the preset's train layout fitted to every device. ``sampler``:
    reuse the generation side of an earlier run of the same model config and ``rl`` shapes
    (its compiled steps); None builds one. ``compiler_options``: XLA options of the update
    step (tests: opt level 0). ``init_from``: a kdsa model folder whose parameters and
    tokenizer start the run (``train/init_from.py``); a run that finishes writes
    ``RUN_DIR/model`` (experts in ``export_experts``, default as in ``init_from``)."""
    tok_path = tokenizer_folder(init_from)
    check_rl_configs(config, tc, rc, tok_path, log=log)
    step_fn = rl_step_with_options(tuple(sorted((compiler_options or {}).items())))
    run_dir = Path(run_dir)
    envs, weights = build_envs(rc, tc.seed)
    multi = jax.process_count() > 1  # rollouts split, one update over every process's devices
    if mesh is None and multi:
        mesh = fit_layout(config, "train", batch=rc.rows_per_micro_batch(tc.accum_steps),
                          seq=rc.seq_len, log=log, per_process_multiple=rc.generate_devices)
    elif mesh is not None:
        check_layout(config, dict(mesh.shape), "train",
                     batch=rc.rows_per_micro_batch(tc.accum_steps), seq=rc.seq_len)
    if multi:  # each step gathers the weights onto every process's generate mesh
        problem = local_gather_problem(mesh.devices.flat, rc.generate_devices)
        if problem:
            raise ValueError(f"rl.generate_devices={rc.generate_devices} with the update's mesh "
                             f"{dict(mesh.shape)}: {problem}; choose --mesh or "
                             f"rl.generate_devices to fit")
    writes = jax.process_index() == 0
    abstract, graphdef, tx, build = prepare(config, tc)
    template = jax.eval_shape(build)
    place = Placement(mesh, graphdef, template, moe_capacity_factor=tc.moe_capacity_factor)
    # writable, room for the checkpoints (and the reference): before compiling; every process
    # takes part (the verdict is agreed), process 0 asks for the room
    check_run_dir(run_dir, state_bytes(template) if writes else 0, tc.keep_checkpoints + 1,
                  resume=resume, also=lambda: check_export_destination(run_dir, init_from))
    ckpt = Checkpointer(run_dir / "checkpoints", every=tc.checkpoint_every,
                        keep=tc.keep_checkpoints)
    layout = abstract.segment_layout
    loss_cfg = rc.loss_config()
    total = rc.sft_steps + rc.steps

    meta0 = {"task_counter": 0, "heldout_before": None, "heldout_before_by_domain": None,
             "init_from": init_from_path(init_from)}  # orbax-to-hf reads it
    restored = ckpt.restore_run(place.template(template), resume=resume, log=log,
                                model_config=config.to_hf_config(), train_config=tc.to_dict(),
                                rl_config=json.loads(json.dumps(rc.to_dict())))
    resumed_from = None
    if restored is not None:
        start, state, meta = restored
        restored, resumed_from = None, start  # no reference left to the host copy
        if "task_counter" not in meta:  # a kdsa train run's checkpoints hold a data index
            raise ValueError(f"--resume: {ckpt.directory / str(start)} is not a kdsa rl "
                             f"checkpoint (no task counter; a kdsa train run: resume it with "
                             f"kdsa train --resume, or start RL from its model with "
                             f"--init-from); use another --run-dir")
        if start > total:
            raise ValueError(f"--resume: checkpoint {ckpt.directory / str(start)} is past "
                             f"this run's {total} steps (sft_steps {rc.sft_steps} + --steps "
                             f"{rc.steps}); give at least --steps {start - rc.sft_steps}")
        meta0 = {k: meta.get(k) for k in meta0} | {  # the weights descend from the first start
            "init_from": resumed_origin(meta.get("init_from"), meta0["init_from"], log)}
        state = place.restored(state)
        log(f"resumed from step {start} ({ckpt.directory / str(start)})")
    elif init_from is not None:  # published weights, restored into the update's layout
        start = 0
        state = initial_state(init_from, config, tc, tx, shardings=place.shardings,
                              mesh=place.mesh)
        log(f"initialised from {init_from}")
    else:
        start, state = 0, place.initial(build, compiler_options)
    counter, before = int(meta0["task_counter"]), meta0["heldout_before"]
    before_d, after_d = meta0["heldout_before_by_domain"], None

    ref_params, ref_ckpt = None, None
    if loss_cfg.kl_beta > 0:  # the reference policy: the weights after SFT, saved once
        ref_ckpt, ref_params = open_reference(
            run_dir, place.template(template).params, resumed=resumed_from is not None,
            past_sft=start > rc.sft_steps, device=None if place.mesh else place.device, log=log)
    if sampler is None:
        sampler = Sampler(nnx.merge(graphdef, state.params, state.rest), config, rc, tc.seed,
                          tok_path)
    if sampler.tok.vocab_size < config.vocab_size:  # the ids the engine samples from
        loss_cfg = dataclasses.replace(loss_cfg, sampled_vocab=sampler.tok.vocab_size)
    rows, T = rc.rollouts_per_step, rc.seq_len
    # drop the lines of steps after the one this run starts from (a fresh run: every line,
    # left by an earlier run into this folder that stopped before its first checkpoint)
    sft_writer = MetricsWriter(run_dir / "sft", tensorboard=False, resume_step=min(
        start, rc.sft_steps)) if rc.sft_steps else None
    writer = MetricsWriter(run_dir, resume_step=max(start - rc.sft_steps, 0))
    rewards, lines = {}, {}
    pending: list = []  # partial rollouts: groups cut by the step cap, continued next step
    stopped, step = False, start
    bar = Progress(total, initial=start, enabled=progress)
    on_every = writes or place.collective  # who calls save (a sharded state: every process)

    def save(force: bool):
        meta = {"task_counter": counter, "heldout_before": before,
                "heldout_before_by_domain": before_d, "train_config": tc.to_dict(),
                "rl_config": rc.to_dict(), "model_config": config.to_hf_config(),
                "init_from": meta0["init_from"]}
        if on_every:
            ckpt.save(step, state, meta, force=force)

    def host(metrics) -> dict:
        return {k: float(v) for k, v in jax.device_get(local_copy(metrics)).items()}

    kw = dict(tc=tc, tx=tx, loss_cfg=loss_cfg, layout=layout)
    # an SFT step's rows (a rollout batch) in as many micro-batches as an RL mini-batch update
    # takes of them all: the micro-batch kdsa plan and the layout check sized, one update (a
    # second compile of the step; train.batch_size, which RL does not use, set to the rows so
    # that TrainConfig's divisibility check holds)
    k = rc.minibatches_per_step
    sft_kw = kw if k == 1 or not rc.sft_steps else dict(kw, tc=dataclasses.replace(
        tc, accum_steps=tc.accum_steps * k, batch_size=rc.rollouts_per_step))
    try:
        with _StopFlag() as flag:
            while step < total:
                t0 = time.perf_counter()
                if step < rc.sft_steps:  # ---- SFT warm-up on demonstrations ----
                    rng = np.random.default_rng([tc.seed, 1, step])
                    tasks = ro.sample_tasks(envs, weights, rows, rc=rc, rng=rng,
                                            start_index=counter)
                    counter += rows
                    batch = sft_batch(sampler.fmt, envs, tasks, rows, T)
                    if rc.routing_replay:  # the RL steps' batch structure (one compile when
                        # minibatches_per_step is 1)
                        batch["expert_ids"] = ro.no_routing(rows, T, _routing_dims(config))
                    with place.rules():
                        state, m = step_fn(graphdef, state, place.batch(batch), 1.0,
                                           None if ref_ckpt is None else state.params, 1.0,
                                           **sft_kw)  # the RL steps' arguments
                    m = host(m)
                    step += 1
                    m["step_time_s"] = time.perf_counter() - t0
                    sft_writer.write(step, m)
                    bar.advance_to(step, desc=f"sft ce {m['ce']:.3f}")
                else:  # ---- RL ----
                    if ref_ckpt is not None and ref_params is None:
                        ref_params = state.params
                        if on_every:
                            ref_ckpt.save(step, ref_params, {"step": step}, force=True)
                    if before is None and evaluate_heldout:
                        sampler.sync(graphdef, state)
                        before, before_d, _ = evaluate(sampler, envs, rc, seed=tc.seed + 17)
                        log(f"\nheld-out reward before RL: {before:.3f} ({_fmt_domains(before_d)})")
                        t0 = time.perf_counter()
                    m, counter = _rl_iteration(sampler, envs, weights, graphdef, state, rc, tc,
                                               step, counter, rows, pending,
                                               _routing_dims(config) if rc.routing_replay else None)
                    batch = m.pop("_batch")
                    m["updated"] = float(m["kept_groups"] > 0)  # no varied group: no update
                    m["update_devices"] = place.size
                    if m["kept_groups"] > 0:
                        scale = (m["kept_groups"] / rc.prompts_per_step
                                 if rc.scale_update_by_kept else 1.0)
                        t1 = time.perf_counter()
                        mbs = split_rows(batch, rc.minibatches_per_step, rc.group_size)
                        with place.rules():
                            state, ms = minibatch_updates(
                                graphdef, state, [place.batch(b) for b in mbs], ref_params,
                                scale, step_fn=step_fn, **kw,
                                active=[bool(b["loss_mask"].any()) for b in mbs])
                        ms = [host(x) for x in ms]
                        m["minibatch_updates"] = float(len(ms))
                        m["updated"] = float(bool(ms))  # (kept groups without a loss token)
                        m.update({key: float((np.sum if key == "moe_dropped" else np.mean)(
                            [x[key] for x in ms])) for key in (ms[0] if ms else ())})
                        m["update_s"] = time.perf_counter() - t1
                    step += 1
                    rl_i = step - rc.sft_steps
                    m["step_time_s"] = time.perf_counter() - t0
                    writer.write(rl_i, m)
                    rewards[rl_i], lines[rl_i] = m["reward"], m
                    bar.advance_to(step, desc=f"rl step {rl_i} reward {m['reward']:.3f}")
                why = stop_reason(flag, stop_at, step, total)
                if why:
                    save(True)
                    ckpt.wait()
                    log(f"\nstopped by {why} after step {step}; checkpoint saved in "
                        f"{ckpt.directory / str(step)}")
                    stopped = True
                    break
                save(step == total)
    except Exception:  # the checkpoints in flight finish, the metrics reach their files
        close_after_error(ckpt, ref_ckpt, writer, sft_writer, bar)
        raise
    after = None
    if not stopped:
        # the last step's checkpoint being written, then the held-out evaluation (minutes): a
        # SIGTERM or Ctrl-C skips the export, and ``--resume`` evaluates and exports. One
        # process stops at once (``Interrupted``); a multi-host job finishes the evaluation
        # first, since every process takes part in its collectives, and then stops on all of
        # them (``stop_reason``)
        # the checkpoint's write is never interrupted: a signal now waits for it
        with _StopFlag() as waited:
            ckpt.wait()
            why = stop_reason(waited, None, step, total)  # every process, whichever got it
        flag = _StopFlag(interrupt=jax.process_count() == 1)
        if not why:
            try:
                with flag:
                    if evaluate_heldout:
                        sampler.sync(graphdef, state)
                        after, after_d, _ = evaluate(sampler, envs, rc, seed=tc.seed + 17)
            except Interrupted:
                pass
            why = stop_reason(flag, None, step, total)
        if why:
            after, after_d, stopped = None, None, True
            log(f"\nstopped by {why} after the last step; checkpoint {step} in "
                f"{ckpt.directory / str(step)} is complete: --resume evaluates and exports")
    ckpt.close()
    if not stopped and (writes or place.collective):  # RUN_DIR/model: every shard's owner
        export_run(run_dir, config, graphdef, state, step=step, init_from=meta0["init_from"],
                   export_experts=export_experts, log=log)
    if ref_ckpt is not None:
        ref_ckpt.close()
    if multi:  # every process finishes the job before any shuts the distributed client down;
        # a long timeout: a process whose compiles miss the persistent cache (its device
        # assignment differs from process 0's) may be minutes behind
        from jax._src import distributed as jax_distributed

        jax_distributed.global_state.client.wait_at_barrier("kdsa_rl_done", 6 * 3600 * 1000)
    writer.close()
    if sft_writer is not None:
        sft_writer.close()
    bar.close()
    result = RLResult(rewards, lines, before, after, before_d, after_d, step, stopped,
                      resumed_from)
    result.sampler, result.state, result.graphdef, result.envs = sampler, state, graphdef, envs
    return result


def _routing_dims(config: ModelConfig) -> tuple[int, int]:
    """``(L_moe, k)`` of the routing-replay arrays: the MoE layers, the experts per token."""
    return len(layers_of(config, ffn="moe")), max(config.num_experts_per_token, 1)


def _rl_iteration(sampler, envs, weights, graphdef, state, rc, tc, step, counter, rows,
                  pending, routing_dims=None):
    """Sync, rollouts (with dynamic-sampling rounds) and the batch; returns metrics.

    ``pending``: groups with episodes cut by the step cap (partial rollouts) in earlier steps;
    they are continued first, with the first round's new episodes; the list is updated in
    place (groups still unfinished ``rl.max_staleness`` steps after they started are dropped).
    With partial rollouts, finished groups past this step's ``prompts_per_step`` (carried
    groups finishing beside new ones) wait there too and lead the next step's batch, under the
    same staleness limit (they were thrown away).
    """
    sync_s = sampler.sync(graphdef, state)
    t0 = time.perf_counter()
    cap = rc.partial_rollout_tokens or None
    kept, finished, carried, dropped, gen, here = [], [], [], 0, 0, 0
    for rnd in range(rc.max_sampling_rounds):
        rng = np.random.default_rng([tc.seed, 2, step, rnd])
        tasks = ro.sample_tasks(envs, weights, rc.prompts_per_step, rc=rc, rng=rng,
                                start_index=counter)
        counter += rc.prompts_per_step
        new = ro.start_episodes(sampler.fmt, tasks, rc.group_size)
        for e in new:
            e.born = step
        groups = [new[g:g + rc.group_size] for g in range(0, len(new), rc.group_size)]
        if rnd == 0:  # finished groups that waited lead the batch; cut ones are continued
            ready = [grp for grp in pending if all(e.done for e in grp)]
            kept += ready
            groups = [grp for grp in pending if not all(e.done for e in grp)] + groups
            pending[:] = []
        before = sum(e.generated for grp in groups for e in grp)
        groups, played = play_split(  # multi-host: each process its share, then all of them
            lambda e, **kw: ro.play(sampler.engine, sampler.fmt, envs, e, **kw), groups, rc=rc,
            step_cap=cap, seed=tc.seed * 100003 + step * 101 + rnd)
        here += played
        gen += sum(e.generated for grp in groups for e in grp) - before
        done = [grp for grp in groups if all(e.done for e in grp)]
        for grp in groups:
            if not all(e.done for e in grp):
                if step - grp[0].born < rc.max_staleness:
                    carried.append(grp)
                else:
                    dropped += 1
        eps = [e for grp in done for e in grp]
        ro.group_rewards(eps, rc.group_size, rc)
        finished += eps
        kept += ro.varied_groups(eps, rc.group_size) if rc.dynamic_sampling else done
        if len(kept) >= rc.prompts_per_step or not rc.dynamic_sampling:
            break
    if cap is not None:  # partial rollouts: finished groups past the batch wait for the next
        for grp in kept[rc.prompts_per_step:]:
            if step - grp[0].born < rc.max_staleness:
                carried.append(grp)
            else:
                dropped += 1
    pending[:] = carried
    kept = kept[:rc.prompts_per_step]
    rollout_s = time.perf_counter() - t0
    m = ro.domain_metrics(finished)
    m.update(sync_seconds=sync_s, rollout_s=rollout_s, rollout_tokens=gen,
             rollout_tokens_per_s=gen / rollout_s if rollout_s > 0 else 0.0,
             kept_groups=len(kept), sampled_groups=len(finished) // rc.group_size,
             rollout_episodes_here=here)  # played by this process (multi-host: its share)
    if cap is not None:
        m.update(pending_groups=len(carried), stale_dropped_groups=dropped)
    m["_batch"] = ro.training_batch(kept, rows, rc.seq_len, rc.group_size, rc, routing_dims)
    return m, counter


def _fmt_domains(d: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in d.items())
