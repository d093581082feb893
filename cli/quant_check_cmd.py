"""``kdsa quant-check``: what quantization changed, on the user's own prompts.

    kdsa quant-check --reference A --candidate B --prompts F.jsonl --out REPORT.json \\
        [--html REPORT.html] [--mesh AXES]
    kdsa quant-check --reference A --candidate-experts mxfp4 --prompts F.jsonl --out R.json

A and B are kdsa model folders (B typically A with MXFP4 experts; ``--candidate-experts mxfp4``
quantizes A's routed experts on the fly instead). Prompts are in the ``kdsa generate`` format.
The two models run one after the other on the ``generate`` layout (``infer/quant_check.py``);
the report holds ``summary.kl_mean``, ``summary.top1_agreement``, per-category tails, greedy
answer / tool-call agreement and the worst prompts.
"""

from __future__ import annotations

import json
import sys

from kdsa.cli.paths import abs_path


def register(sub) -> None:
    from kdsa.cli.config_args import add_layout_args, positive_int

    p = sub.add_parser("quant-check", help="compare a model with its quantized version",
                       description=__doc__.splitlines()[0])
    p.add_argument("--reference", type=abs_path, required=True, metavar="DIR",
                   help="the reference model folder (e.g. bf16 experts)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--candidate", type=abs_path, metavar="DIR",
                   help="the candidate model folder (e.g. MXFP4 experts)")
    g.add_argument("--candidate-experts", choices=("mxfp4",),
                   help="quantize the reference's routed experts on the fly instead")
    p.add_argument("--prompts", type=abs_path, required=True, help="JSONL, kdsa generate format")
    p.add_argument("--out", type=abs_path, required=True, help="the JSON report")
    p.add_argument("--html", type=abs_path, default=None, help="also an HTML page")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out / --html")
    p.add_argument("--tokenizer", type=abs_path, default=None,
                   help="default: the reference folder's, else the byte tokenizer")
    p.add_argument("--chat-format", default="xtml", choices=("xtml", "k2"))
    p.add_argument("--effort", default="high", choices=("low", "high", "max"),
                   help="thinking effort for chat lines without reasoning_effort")
    p.add_argument("--max-tokens", type=int, default=256, help="greedy tokens per prompt")
    p.add_argument("--top-k", type=int, default=1024,
                   help="the reference's tokens kept per position for the KL (exact when >= "
                        "the vocabulary; otherwise the KL of top-k + rest, a lower bound)")
    p.add_argument("--slots", type=positive_int, default=8)
    p.add_argument("--max-len", type=positive_int, default=2048)
    p.add_argument("--prefill-chunk", type=positive_int, default=256)
    p.add_argument("--mesh", default=None, help="generate-layout mesh axes, as kdsa generate")
    add_layout_args(p)
    p.set_defaults(run=run, config=None)


def run(args) -> int:
    from pathlib import Path

    from kdsa.cli.config_args import layout_override
    from kdsa.train.init_from import tokenizer_folder
    from kdsa.infer.generate import load_checkpoint, prompts_file
    from kdsa.infer.quant_check import run_quant_check, with_mxfp4_experts
    from kdsa.model.checkpoint import read_info
    from kdsa.sharding.mesh import fit_layout
    from kdsa.sharding.rules import layout_shardings

    if args.max_tokens < 1 or args.top_k < 1:
        raise ValueError("--max-tokens and --top-k must be >= 1")
    import jax

    from kdsa.cli.paths import output_file

    prompts_file(args.prompts)
    config, _ = read_info(args.reference)  # a clear error for a folder that is no model
    if args.candidate is not None:  # the same model stored otherwise, checked before either runs
        from kdsa.train.init_from import same_architecture

        candidate, _ = read_info(args.candidate)
        # (dtypes, kernels and the experts' storage may differ: that is what is compared)
        if not same_architecture(config, candidate.replace(param_dtype=config.param_dtype)):
            ref, cand = config.to_hf_config(), candidate.to_hf_config()
            differ = [k for k in sorted(ref.keys() | cand.keys()) if ref.get(k) != cand.get(k)
                      and k not in ("quantization_config", "torch_dtype")][:4]
            raise ValueError(f"--candidate {args.candidate}: another model than --reference "
                             f"(differs in {', '.join(differ) or 'its architecture'}); "
                             f"quant-check compares one model stored two ways")
    elif not config.num_experts or config.expert_weight_format == "mxfp4":
        raise ValueError("--candidate-experts mxfp4 needs a reference with bf16 routed experts")
    def destinations():  # ready before the two models run, not after; checked by the one
        if jax.process_index() != 0:  # process that writes them, every process hears
            return
        output_file(Path(args.out), "--out", inputs=(("--prompts", args.prompts),))
        if args.html is not None:
            output_file(Path(args.html), "--html",
                        inputs=(("--prompts", args.prompts), ("--out", args.out)))
        for flag, path in (("--out", args.out), ("--html", args.html)):
            if path is not None and Path(path).is_file() and not args.overwrite:
                raise ValueError(f"{flag} {path} exists; --overwrite replaces it")

    from kdsa.sharding.agreement import agreed

    agreed(destinations, "--out")
    sizes = layout_override(args, "generate")
    mesh = None
    if sizes:
        mesh = fit_layout(config, "generate", override=sizes, batch=args.slots)
    tok = args.tokenizer if args.tokenizer is not None else tokenizer_folder(args.reference)

    def load_reference():
        return load_checkpoint(args.reference, mesh=mesh)

    def load_candidate():
        if args.candidate is not None:
            return load_checkpoint(args.candidate, mesh=mesh)
        cfg, model = load_checkpoint(args.reference, mesh=mesh)
        return with_mxfp4_experts(cfg, model, layout_shardings(mesh, "generate"))

    engine_kw = dict(num_slots=args.slots, max_len=args.max_len,
                     prefill_chunk=args.prefill_chunk, tokenizer_path=tok,
                     chat_format=args.chat_format, mesh=mesh)
    report = run_quant_check(load_reference, load_candidate, args.prompts, engine_kw=engine_kw,
                             effort=args.effort, max_tokens=args.max_tokens, top_k=args.top_k,
                             mesh=mesh, log=lambda m: print(m, file=sys.stderr, flush=True))
    report["reference"] = str(args.reference)
    report["candidate"] = str(args.candidate) if args.candidate else "reference, MXFP4 experts"

    if jax.process_index() == 0:
        from kdsa.infer.jsonl import write_atomic

        write_atomic(args.out, json.dumps(report, indent=1) + "\n")
        if args.html is not None:
            from kdsa.infer.quant_report import write_html

            write_html(report, args.html)
        s = report["summary"]
        print(f"quant-check: {s['prompts']} prompts, {s['tokens']} tokens: KL mean "
              f"{s['kl_mean']:.3g}, top-1 agreement {s['top1_agreement']:.3f}, answers equal "
              f"{s['answer_match']:.2f}, tool calls equal {s['tool_args_match']:.2f} -> "
              f"{args.out}")
    return 0
