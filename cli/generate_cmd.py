"""``kdsa generate``: batched (and sharded, multi-host) generation from a JSONL of prompts.

``add_engine_args`` / ``engine_from_args`` are shared with ``kdsa serve``.
"""

from __future__ import annotations

from kdsa.cli.paths import abs_path


def add_engine_args(p) -> None:
    from kdsa.cli.config_args import add_config_args, add_layout_args

    add_config_args(p, default_preset="tiny")
    add_layout_args(p)
    g = p.add_argument_group("engine")
    g.add_argument("--checkpoint", type=abs_path, default=None,
                   help="model folder for kdsa.model.checkpoint.load_model (else --preset with "
                        "random weights, for smoke runs)")
    g.add_argument("--tokenizer", type=abs_path, default=None,
                   help="tiktoken.model or tokenizer.json (or a folder holding one); default: "
                        "the checkpoint folder's, else the built-in byte-level tokenizer")
    g.add_argument("--chat-format", default="xtml", choices=("xtml", "k2"))
    g.add_argument("--slots", type=int, default=8, help="concurrent sequences (batch rows)")
    g.add_argument("--max-len", type=int, default=1024, help="context per slot (tokens)")
    g.add_argument("--prefill-chunk", type=int, default=256)
    g.add_argument("--num-pages", type=int, default=None,
                   help="paged cache: the DSA layers' rows in one pool of this many 64-token "
                        "pages shared by all requests; a request reserves the pages of its "
                        "prompt + max_tokens and waits while they are not free (default: "
                        "--slots x the pages of --max-len, the dense cache's memory; on a "
                        "mesh split evenly over the batch device groups, data x fsdp x "
                        "expert, each serving its own slots from its own pages)")
    g.add_argument("--cache-memory", default=None,
                   help="paged cache sized in bytes per device instead (e.g. 2GiB): as many "
                        "pages as fit, in each batch device group of a mesh")
    g.add_argument("--dense-cache", action="store_true",
                   help="a dense --max-len cache row per slot instead of the paged pool (no "
                        "prefix cache)")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="paged cache without prefix caching (by default a request resumes "
                        "from the KDA snapshot and DSA pages of the longest cached prefix)")
    g.add_argument("--prefix-snapshot-every", type=int, default=4, metavar="PAGES",
                   help="prefix cache: snapshot the KDA states every this many pages of a "
                        "prefill (default 4 = 256 tokens)")
    g.add_argument("--prefix-snapshots", type=int, default=None, metavar="N",
                   help="prefix cache: KDA snapshot slots (default: 2 x --slots; each holds "
                        "one sequence's KDA states, see kdsa params; on a mesh a multiple of "
                        "the batch device groups, which split them)")
    g.add_argument("--batched-prefill", action="store_true",
                   help="prefill a chunk of every slot with prompt left in one step (one "
                        "device, text models; off by default until its speed is measured; "
                        "every (row count, bucket) compiles in the warm-up)")
    g.add_argument("--layout", default="generate", choices=("generate", "train"),
                   help="sharding layout (kdsa.sharding.rules; default generate)")
    g.add_argument("--mesh", default=None,
                   help="mesh axes of the layout over every process's devices, e.g. "
                        "data=2,expert=2,tensor=2 (--slots must be a multiple of "
                        "data x fsdp x expert); default: one device, or the preset's generate "
                        "layout fitted to the devices in a multi-process job")
    g.add_argument("--seed", type=int, default=0)
    b = p.add_argument_group("thinking budgets (reasoning-token caps per effort level)")
    b.add_argument("--budget-low", type=int, default=2048)
    b.add_argument("--budget-high", type=int, default=8192)
    b.add_argument("--budget-max", type=int, default=32768)
    b.add_argument("--budget-grace", type=int, default=32,
                   help="tokens to wait for a sentence end once a cap is reached")


def engine_from_args(args):
    """(engine, chat format, config name) from the parsed arguments."""
    from pathlib import Path

    from flax import nnx

    from kdsa.cli.config_args import config_from_args
    from kdsa.infer.budget import BudgetConfig
    from kdsa.infer.generate import build_engine, load_checkpoint
    from kdsa.model.transformer import Transformer

    import jax

    from kdsa.sharding.mesh import fit_layout

    from kdsa.cli.config_args import layout_override

    counts = [("--slots", args.slots), ("--max-len", args.max_len),
              ("--prefill-chunk", args.prefill_chunk), ("--num-pages", args.num_pages)]
    if not (args.dense_cache or args.no_prefix_cache):  # (unused otherwise)
        counts += [("--prefix-snapshot-every", args.prefix_snapshot_every),
                   ("--prefix-snapshots", args.prefix_snapshots)]
    for flag, value in counts:
        if value is not None and value < 1:  # (before the model is built)
            hint = " (--no-prefix-cache turns it off)" if "prefix" in flag else ""
            raise ValueError(f"{flag} must be >= 1, got {value}{hint}")
    sizes = layout_override(args, args.layout)  # --mesh, --layouts or --config's mesh section
    from kdsa.cli.convert_cmd import parse_size
    cache_bytes = (None if args.cache_memory is None  # (read before the model is built)
                   else parse_size(args.cache_memory, "--cache-memory"))
    if cache_bytes is not None and args.num_pages is not None:
        raise ValueError("give --num-pages or --cache-memory, not both")
    if args.dense_cache and (args.num_pages is not None or cache_bytes is not None):
        raise ValueError("--dense-cache takes no pool size: drop --num-pages / --cache-memory")

    def mesh_for(config, preset):
        if not sizes and jax.process_count() == 1:
            return None
        return fit_layout(config, args.layout, preset=preset, override=sizes,
                          batch=args.slots)

    tok_path = args.tokenizer
    if args.checkpoint:
        if args.preset or args.config or args.overrides:
            raise ValueError("--checkpoint brings its own config; drop --preset/--config/--set")
        from kdsa.model.checkpoint import read_info
        mesh = mesh_for(read_info(args.checkpoint)[0], None)
        config, model = load_checkpoint(args.checkpoint, mesh=mesh, layout=args.layout)
        name = Path(args.checkpoint).name
        ck = Path(args.checkpoint)
        if tok_path is None and any((ck / f).is_file() for f in ("tiktoken.model",
                                                                 "tokenizer.json")):
            tok_path = ck
    else:
        name, config = config_from_args(args)
        mesh = mesh_for(config, name)
        make = lambda: Transformer(config, rngs=nnx.Rngs(args.seed))  # noqa: E731
        if mesh is None:
            model = make()
        else:  # random weights made in the layout, each device its own shards
            from kdsa.sharding.rules import build_sharded
            model = build_sharded(make, mesh, args.layout)
    budgets = BudgetConfig(caps={"low": args.budget_low, "high": args.budget_high,
                                 "max": args.budget_max}, grace=args.budget_grace)
    num_pages = args.num_pages
    if cache_bytes is not None:
        from kdsa.infer.page_pool import pages_in
        from kdsa.infer.cache_layout import rope_lanes_for
        num_pages = pages_in(cache_bytes, config, rope_lanes_for(mesh))
        if mesh is not None:  # the bytes of one device: one group's partition of the pool
            from kdsa.sharding.rules import batch_groups
            num_pages *= batch_groups(mesh, args.layout)[1]
    if num_pages is None and not args.dense_cache and any(
            m != "kda" for m in config.mixer_kinds):  # paged + prefix cache by default
        from kdsa.model.paged_cache import pages_for
        num_pages = args.slots * pages_for(args.max_len)
    engine, fmt = build_engine(model, num_slots=args.slots, max_len=args.max_len,
                               prefill_chunk=args.prefill_chunk, tokenizer_path=tok_path,
                               chat_format=args.chat_format, budgets=budgets, mesh=mesh,
                               layout=args.layout, seed=args.seed, num_pages=num_pages,
                               prefix_snapshots=0 if num_pages is None or args.no_prefix_cache
                               else (2 * args.slots if args.prefix_snapshots is None
                                     else args.prefix_snapshots),
                               prefix_snapshot_every=args.prefix_snapshot_every,
                               batched_prefill=args.batched_prefill)
    return engine, fmt, name


def register(sub) -> None:
    p = sub.add_parser("generate", help="batched generation from a JSONL of prompts",
                       description="Generate completions for every line of --prompts (chat "
                                   "messages, raw text or token ids) with continuous batching "
                                   "and write one JSON line per request to --out. Every host "
                                   "runs the same command; process 0 writes.")
    add_engine_args(p)
    p.add_argument("--prompts", type=abs_path, required=True, help="input JSONL")
    p.add_argument("--out", type=abs_path, required=True,
                   help="output JSONL (written by process 0, record by record into "
                        "OUT.partial, renamed to OUT at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue the job an interruption left in OUT.partial: its records "
                        "are kept, the remaining lines generated")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--effort", default="max", choices=("low", "high", "max"),
                   help="thinking effort for chat requests without reasoning_effort")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def check_results_destination(out, *, resume: bool, overwrite: bool) -> None:
    """Before the model is built: an existing ``--out`` is replaced only with ``--overwrite``;
    the records an interrupted job left in ``OUT.partial`` are continued with ``--resume``,
    or refused (never silently thrown away)."""
    from kdsa.infer.jsonl import partial_of

    partial = partial_of(out)
    if resume and not partial.is_file() and out.is_file() and not overwrite:
        raise ValueError(f"--resume: {out} is complete (no {partial.name} to continue); "
                         f"--overwrite generates it again")
    if not resume and partial.is_file():
        raise ValueError(f"--out {out}: an interrupted job left {partial}; --resume continues "
                         f"it, or delete it to start over")
    if out.is_file() and not overwrite and not resume:
        raise ValueError(f"--out {out} exists; --overwrite replaces it")


def run(args) -> int:
    """Exit 0 when every line was served, 1 when some were written as error records (one
    summary line on stderr); a file that cannot be read at all is a ValueError (exit 2)."""
    import sys

    import jax

    from kdsa.cli.paths import output_file
    from kdsa.infer import openai_api as api
    from kdsa.infer.generate import prompts_file, read_requests, run_job
    from kdsa.sharding.agreement import agreed

    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "top_k": args.top_k}
    try:  # the command's own defaults, checked before the model is built (a line's: later),
        api.sampling_fields(defaults)  # by the rules every line's fields meet
    except api.ApiError as e:
        raise ValueError(f"the sampling flags: {e}") from None
    prompts_file(args.prompts)

    def destination():  # the one process that writes it checks; every process hears
        if jax.process_index() == 0:
            output_file(args.out, "--out", inputs=(("--prompts", args.prompts),))
            check_results_destination(args.out, resume=args.resume, overwrite=args.overwrite)

    agreed(destination, "--out")
    engine, fmt, name = engine_from_args(args)
    reqs = read_requests(args.prompts, engine, fmt, effort=args.effort, defaults=defaults,
                         seed=args.seed, strict=False)
    writer = jax.process_index() == 0
    try:
        summary = run_job(engine, reqs, args.out, writer=writer,
                          progress=not args.no_progress, resume=args.resume)
    except KeyboardInterrupt:
        if writer:
            from kdsa.infer.jsonl import partial_of
            print(f"kdsa generate: the finished records are in {partial_of(args.out)}; the "
                  f"same command with --resume continues", file=sys.stderr)
        raise
    if writer:
        print(f"model {name}: {summary['served']} of {summary['requests']} requests, "
              f"{summary['prompt_tokens']} prompt "
              f"tokens, {summary['generated_tokens']} generated tokens in "
              f"{summary['elapsed_s']:.1f}s ({summary['tokens_per_s']:.1f} tokens/s), mean "
              f"TTFT {summary['mean_ttft_s']:.2f}s, finish {summary['finish_reasons']} -> "
              f"{args.out}")
    if summary["failed"]:
        if writer:
            print(f"kdsa generate: error: {summary['failed']} of {summary['requests']} "
                  f"requests failed (error records in {args.out}); first: "
                  f"{summary['errors'][0]}", file=sys.stderr)
        return 1
    return 0
