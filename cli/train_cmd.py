"""``kdsa train``: pre-train / fine-tune a preset on synthetic or JSONL data, with checkpoints."""

from __future__ import annotations

import sys

from kdsa.cli.paths import abs_path


def register(sub) -> None:
    from kdsa.cli.config_args import add_config_args, add_init_from_args, add_layout_args

    p = sub.add_parser(
        "train", help="train a model (synthetic or JSONL data), checkpointing and resuming",
        description="Train with the jitted train step: next-token loss, AdamW or Muon, "
                    "warm-up + cosine, gradient accumulation, MoE routing-bias updates, DSA "
                    "indexer stages. Writes RUN_DIR/metrics.jsonl, a TensorBoard event file and "
                    "Orbax checkpoints in RUN_DIR/checkpoints, and RUN_DIR/model when it "
                    "finishes. SIGTERM or Ctrl-C saves and exits 143; --resume continues from "
                    "the newest readable checkpoint. See docs/training.md.")
    add_config_args(p, default_preset="tiny")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (train.steps)")
    p.add_argument("--seed", type=int, default=None, help="seed of init and data (train.seed)")
    p.add_argument("--run-dir", type=abs_path, required=True, help="output directory")
    p.add_argument("--data", type=abs_path, default=None,
                   help="JSONL file of {\"tokens\": [...]} or {\"text\": ...} documents, or of "
                        "{\"messages\": [...]} chat examples (SFT on the last assistant turn; "
                        "image_url / image parts need a preset with a vision tower; "
                        "docs/vision.md) (default: synthetic data)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest readable checkpoint in --run-dir")
    p.add_argument("--train-set", dest="train_overrides", action="append", default=[],
                   metavar="KEY=VALUE",
                   help="set a TrainConfig field, e.g. --train-set learning_rate=1e-3 "
                        "--train-set accum_steps=4 (value parsed as JSON)")
    p.add_argument("--mesh", default=None, metavar="AXES",
                   help="mesh axis sizes for the train layout, e.g. data=2,fsdp=2,expert=2 "
                        "(axes data, fsdp, expert, tensor, sequence; one may be -1 = the rest; "
                        "over every process's devices). Default: the preset's train layout "
                        "fitted to the devices and the micro-batch (docs/sharding.md)")
    add_layout_args(p)
    add_init_from_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


def train_config_from_args(args):
    from kdsa.train.config import TrainConfig, apply_train_overrides

    # --steps / --seed first: the overrides are validated against them (a warm-up of 100
    # steps is fine for --steps 1000, not for the default 100); then they win over the overrides
    changes = {k: v for k, v in (("steps", args.steps), ("seed", args.seed)) if v is not None}
    tc = apply_train_overrides(TrainConfig(**changes), args.train_overrides)
    return tc.replace(**changes) if changes else tc


def _read_data(path, config, tc, tok):
    """``--data`` read and checked before anything compiles: chat JSONL (every line, images
    decoded), or text / token JSONL through the model's tokenizer; the path itself for the
    byte-level reader of ``run_training``."""
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file")
    from kdsa.train.vision_data import chat_sft_data, is_chat_jsonl
    if is_chat_jsonl(path):
        return chat_sft_data(config, tc, path, tokenizer=tok)
    if tok is not None:
        from kdsa.train.data import PackedJsonlData
        return PackedJsonlData(path, tc.batch_size, tc.seq_len, tc.seed,
                               vocab_size=config.vocab_size, eos_id=config.eos_token_id,
                               pad_id=config.pad_token_id or 0, tokenizer=tok)
    return path


def run(args) -> int:
    import jax

    from kdsa.cli.config_args import layout_override, model_from_args, model_tokenizer
    from kdsa.train.trainer import SIGTERM_EXIT_CODE, check_configs, run_training

    name, config = model_from_args(args)
    mesh_sizes = layout_override(args, "train")  # a bad layouts file fails before compiling
    tc = train_config_from_args(args)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.init_from is not None:  # a converted K3 with a new indexer: dense warm-up
        from kdsa.train.init_from import indexer_stage_for
        chosen = any(o.partition("=")[0].removeprefix("train.") == "indexer_stage"
                     for o in args.train_overrides)
        warm = indexer_stage_for(args.init_from, tc, chosen=chosen)
        if warm is not tc:
            log(f"{args.init_from}: its DSA indexer is freshly initialised; training starts "
                f"in the dense warm-up stage (--train-set indexer_stage=... to choose)")
        tc = warm
    check_configs(config, tc)  # every config error before anything compiles
    tok = model_tokenizer(args, config)  # the model's own (--init-from), else bytes
    data = args.data
    if data is not None:  # on every host, which must agree (sharding/agreement.py)
        from kdsa.sharding.agreement import agreed
        data = agreed(lambda: _read_data(args.data, config, tc, tok), f"--data {args.data}")
    from kdsa.sharding.mesh import fit_layout
    mesh = fit_layout(config, "train", preset=name, override=mesh_sizes,
                      batch=tc.micro_batch_size, seq=tc.seq_len, log=log)
    axes = ",".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1) or "one device"
    log(f"kdsa train: {name}, {tc.steps} steps, batch {tc.batch_size} x {tc.seq_len} "
        f"(accum {tc.accum_steps}), {tc.optimizer}, mesh {axes} ({jax.process_count()} "
        f"process(es)), run dir {args.run_dir}")
    result = run_training(config, tc, args.run_dir, data_path=data, resume=args.resume,
                          progress=not args.no_progress and jax.process_index() == 0,
                          mesh=mesh, init_from=args.init_from,
                          export_experts=args.export_experts)
    last = result.losses.get(result.final_step)
    print(f"step {result.final_step}/{tc.steps}" + (f" loss {last:.4f}" if last is not None
                                                    else ""), flush=True)
    return SIGTERM_EXIT_CODE if result.stopped else 0
