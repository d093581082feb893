"""``kdsa plan``: per-device memory and per-step communication of a layout (no devices needed).

    kdsa plan --preset k3-2.8t --layout train --mesh expert=64,fsdp=16 --device-memory 141GiB \
        --batch 1024 --seq 8192

Exit status 0 when the layout fits, 3 when it does not (the message names the largest term),
2 for a layout that does not divide the model or batch (``kdsa plan`` names the axis).
"""

from __future__ import annotations

import json

from kdsa.cli.config_args import (add_config_args, add_layout_args, config_from_args,
                                  layout_override)


def register(sub) -> None:
    p = sub.add_parser("plan", help="memory and communication of a sharding layout",
                       description=__doc__.splitlines()[0])
    add_config_args(p, default_preset="k3-2.8t")
    p.add_argument("--layout", choices=("train", "generate"), default="train")
    p.add_argument("--mesh", default=None,
                   help="axis sizes, e.g. data=2,fsdp=16,expert=64 (default: the preset's "
                        "layout); -1 takes the rest of --devices")
    add_layout_args(p)
    p.add_argument("--devices", type=int, default=None,
                   help="device count, to resolve a -1 in --mesh or the preset default")
    p.add_argument("--device-memory", default="141GiB", help="memory per device (141GiB)")
    p.add_argument("--batch", type=int, default=None,
                   help="global batch (train: sequences per step; generate: concurrent "
                        "sequences); default: the data-parallel degree")
    p.add_argument("--seq", type=int, default=8192,
                   help="tokens per sequence (generate: the context the caches hold)")
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--moe-capacity-factor", type=float, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from kdsa.sharding.mesh import AXES, layout_sizes, resolve_sizes
    from kdsa.sharding.plan import format_plan, make_plan, parse_bytes
    from kdsa.sharding.rules import get_rules

    name, config = config_from_args(args)
    sizes = layout_sizes(name, args.layout, layout_override(args, args.layout))
    if -1 in sizes.values():
        if args.devices is None:
            raise ValueError(f"mesh {sizes} has a -1 axis: give --devices to resolve it")
        sizes = dict(zip(AXES, resolve_sizes(sizes, args.devices)))
    elif args.devices is not None and args.devices != _prod(sizes.values()):
        resolve_sizes(sizes, args.devices)  # raises: which product does not match
    batch = args.batch
    if batch is None:
        batch = _prod(sizes[a] for a in (get_rules(args.layout)["act_batch"] or ()))
    plan = make_plan(config, args.layout, sizes, device_memory=parse_bytes(args.device_memory),
                     batch=batch, seq=args.seq, prefill_chunk=args.prefill_chunk,
                     moe_capacity_factor=args.moe_capacity_factor)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(format_plan(plan, name))
    return 0 if plan.fits else 3


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out
