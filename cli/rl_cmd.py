"""``kdsa rl``: reinforcement learning on verifiable environments (and the main demo)."""

from __future__ import annotations

import sys

from kdsa.cli.paths import abs_path


def register(sub) -> None:
    from kdsa.cli.config_args import add_config_args, add_init_from_args, add_layout_args

    p = sub.add_parser(
        "rl", help="RL on reasoning-gym / tool-use environments (SFT warm-up, GRPO/DAPO/GSPO/"
                   "Kimi losses); --demo runs the main demo",
        description="Rollouts from the generation engine on the trained weights (resharded to "
                    "the generate layout each step), rewards from the environments, group "
                    "advantages, a jitted policy-loss update. Writes RUN_DIR/metrics.jsonl (one "
                    "line per RL step), RUN_DIR/sft/metrics.jsonl, Orbax checkpoints in "
                    "RUN_DIR/checkpoints; SIGTERM or Ctrl-C saves and exits 143, --resume "
                    "continues. "
                    "See docs/rl.md.")
    add_config_args(p, default_preset="tiny")
    p.add_argument("--demo", action="store_true",
                   help="the main demo: tiny model, SFT warm-up, RL on three reasoning-gym "
                        "families, held-out reward before/after, reward-curve PNG")
    p.add_argument("--rl-config", type=abs_path, default=None,
                   help="JSON object of RLConfig fields (e.g. the envs list)")
    p.add_argument("--rl-set", dest="rl_overrides", action="append", default=[],
                   metavar="KEY=VALUE",
                   help="set an RLConfig field, e.g. --rl-set loss=dapo --rl-set "
                        "'envs=[\"rg:chain_sum\"]' (value parsed as JSON)")
    p.add_argument("--train-set", dest="train_overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="set a TrainConfig field (optimizer, lr, ...)")
    p.add_argument("--steps", type=int, default=None, help="RL steps (rl.steps)")
    p.add_argument("--seed", type=int, default=None, help="seed of init, tasks and sampling")
    p.add_argument("--run-dir", type=abs_path, default=None,
                   help="output directory (required unless --demo: runs/rl-demo)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest readable checkpoint in --run-dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--mesh", default=None, metavar="AXES",
                   help="mesh axis sizes of the update's train layout, e.g. "
                        "fsdp=2,expert=2,tensor=2 (axes data, fsdp, expert, tensor, sequence; "
                        "one may be -1; over every process's devices); rollouts run on each "
                        "process's generate mesh and the weights are resharded every step. "
                        "Default: one device, or in a multi-process job the preset's train "
                        "layout fitted to the devices (docs/rl.md)")
    add_layout_args(p)
    add_init_from_args(p)
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not keep compiled programs in ~/.cache/kdsa/jax ($KDSA_CACHE)")
    p.set_defaults(run=run)


def configs_from_args(args):
    """``(name, model config, TrainConfig, RLConfig)``; every config error raises ValueError."""
    import dataclasses

    from kdsa.cli.config_args import model_from_args
    from kdsa.model.overrides import apply_overrides
    from kdsa.model.config import get_preset
    from kdsa.train.config import TrainConfig, apply_train_overrides
    from kdsa.train.rl.config import RLConfig, apply_rl_overrides
    from kdsa.train.rl.demo import demo_configs

    if args.demo and not (args.preset or args.config or args.init_from):
        name, tc, rc = demo_configs()
        config = apply_overrides(get_preset(name), args.overrides)
    else:
        name, config = model_from_args(args)
        tc, rc = TrainConfig(steps=1, schedule="constant", warmup_steps=0), RLConfig()
        if args.demo:
            _, tc, rc = demo_configs()
    if args.rl_config is not None:
        from kdsa.cli.config_args import read_json_file

        raw = read_json_file(args.rl_config, "--rl-config")
        if not isinstance(raw, dict):
            raise ValueError(f"--rl-config {args.rl_config}: must be a JSON object")
        names = {f.name for f in dataclasses.fields(RLConfig)}
        bad = sorted(set(raw) - names)
        if bad:
            raise ValueError(f"--rl-config {args.rl_config}: unknown RL config fields {bad}")
        rc = dataclasses.replace(rc, **raw)
    rc = apply_rl_overrides(rc, args.rl_overrides)
    if args.steps is not None:
        rc = rc.replace(steps=args.steps)
    tc = apply_train_overrides(tc.replace(steps=rc.optimizer_steps), args.train_overrides)
    if args.seed is not None:
        tc = tc.replace(seed=args.seed)
    return name, config, tc, rc


def run(args) -> int:
    import jax

    from kdsa.train.init_from import tokenizer_folder
    from kdsa.train.rl.preflight import check_rl_configs
    from kdsa.train.trainer import SIGTERM_EXIT_CODE

    name, config, tc, rc = configs_from_args(args)
    run_dir = args.run_dir or (_demo_run_dir(args.resume) if args.demo else None)
    if run_dir is None:
        raise ValueError("--run-dir is required (unless --demo)")
    if args.demo and args.init_from is not None:
        raise ValueError("--demo trains its own tiny model from scratch; drop --init-from")
    check_rl_configs(config, tc, rc, tokenizer_folder(args.init_from))  # before compiling
    mesh = _train_mesh(args, name, config, tc, rc)
    from kdsa.train.rl.demo import default_cache_dir, enable_compilation_cache, run_demo

    if not args.no_compile_cache:
        enable_compilation_cache(default_cache_dir())
    envs = ", ".join(e.name for e in rc.envs)
    print(f"kdsa rl: {name}, {rc.sft_steps} SFT + {rc.steps} RL steps, {rc.prompts_per_step} "
          f"prompts x {rc.group_size} samples, loss {rc.loss}, envs {envs}, run dir {run_dir}",
          file=sys.stderr, flush=True)
    if args.demo:
        return run_demo(config, tc, rc, run_dir, resume=args.resume, mesh=mesh,
                        progress=not args.no_progress and jax.process_index() == 0)
    from kdsa.train.rl.loop import run_rl

    result = run_rl(config, tc, rc, run_dir, resume=args.resume, mesh=mesh,
                    init_from=args.init_from, export_experts=args.export_experts,
                    progress=not args.no_progress and jax.process_index() == 0)
    if result.stopped:
        return SIGTERM_EXIT_CODE
    last = result.rewards.get(max(result.rewards, default=0))
    print(f"step {result.final_step}/{rc.sft_steps + rc.steps}"
          + (f" reward {last:.4f}" if last is not None else ""))
    if result.heldout_before is not None and result.heldout_after is not None:
        print(f"held-out reward: before {result.heldout_before:.3f} -> after "
              f"{result.heldout_after:.3f}")
    return 0


def _train_mesh(args, name, config, tc, rc):
    """The update's mesh: ``--mesh`` > ``--layouts`` > the config's mesh section; None (one
    device) when none is given in a one-process job; the preset's train layout fitted to the
    devices in a multi-process job."""
    import jax

    from kdsa.cli.config_args import layout_override
    from kdsa.sharding.mesh import fit_layout

    sizes = layout_override(args, "train")
    if sizes is None and jax.process_count() == 1:
        return None
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    return fit_layout(config, "train", preset=name, override=sizes,
                      batch=rc.rows_per_micro_batch(tc.accum_steps), seq=rc.seq_len, log=log,
                      per_process_multiple=rc.generate_devices)


def _demo_run_dir(resume: bool):
    """``runs/rl-demo``, or when an earlier demo left checkpoints there the first free
    ``runs/rl-demo-N``: a rerun never mixes with, nor replaces, an earlier one. With
    ``--resume`` the newest of those that did not finish (no ``model/`` export yet), else the
    newest: the run a stopped ``--demo`` left."""
    base = abs_path("runs/rl-demo")
    taken = []  # the demo folders holding checkpoints, oldest first
    n, path = 1, base
    while (path / "checkpoints").is_dir() and any((path / "checkpoints").iterdir()):
        taken.append(path)
        n += 1
        path = base.with_name(f"rl-demo-{n}")
    if resume:
        unfinished = [p for p in taken if not (p / "model").is_dir()]
        pick = (unfinished or taken or [base])[-1]
        if pick != base:
            print(f"kdsa rl --demo --resume: resuming {pick}", file=sys.stderr)
        return pick
    if path != base:
        print(f"kdsa rl --demo: {base} holds an earlier run; writing to {path}",
              file=sys.stderr)
    return path
