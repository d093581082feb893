"""``kdsa params``: parameter table, weight bytes and decode-cache bytes of a config."""

from __future__ import annotations

import json

from kdsa.cli.config_args import add_config_args, config_from_args, positive_int


def register(sub) -> None:
    p = sub.add_parser("params", help="count total and activated parameters (no allocation)",
                       description="Count parameters per component from abstract shapes "
                                   "(nnx.eval_shape), so k3-2.8t is counted without memory.")
    add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--context", type=positive_int, default=None,
                   help="also print the decode cache for one sequence of this many tokens "
                        "(with --json: decode_cache_bytes_at_context)")
    p.set_defaults(run=run)


def run(args) -> int:
    from kdsa.model.count import count_params, format_report

    name, config = config_from_args(args)
    report = count_params(config, preset=name)
    if args.json:
        out = report.to_json()
        if args.context:
            out["context"] = args.context
            out["decode_cache_bytes_at_context"] = (report.cache_bytes_per_token * args.context
                                                    + report.cache_bytes_per_sequence)
        print(json.dumps(out, indent=2))
    else:
        print(f"preset: {name}")
        print(format_report(report, context_len=args.context))
    return 0
