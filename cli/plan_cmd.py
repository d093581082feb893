"""``kdsa plan``: per-device memory and per-step communication of a layout (no devices needed).

    kdsa plan --preset k3-2.8t --layout train --mesh expert=64,fsdp=16 --device-memory 141GiB \
        --batch 1024 --seq 8192

Exit status 0 when the layout fits, 3 when it does not (the message names the largest term),
2 for a layout that does not divide the model or batch (``kdsa plan`` names the axis).

``--compile --topology v5p:8x8x16`` (needs libtpu) also compiles the real steps for that TPU
topology with XLA:TPU: with ``--layout train`` the train step (loss, gradients, optimizer
update, the configured remat; ``train/aot.py``), with ``--layout generate`` the engine's prefill
chunk and decode step over the dense-slot cache (``--batch`` slots of ``--seq`` tokens,
``--prefill-chunk``; ``infer/aot.py``). It prints XLA's per-device memory of each beside the
estimate and the compile time, and refuses (exit 3) a program whose compiled peak exceeds the
chip's HBM (``--device-memory`` when given, else the chip's: ``sharding/aot.py``), or one
XLA:TPU itself refuses for its HBM (its message is printed; the other steps still compile).
"""

from __future__ import annotations

import json

from kdsa.cli.config_args import (add_config_args, add_layout_args, config_from_args,
                                  layout_override, positive_float, positive_int)


def register(sub) -> None:
    p = sub.add_parser("plan", help="memory and communication of a sharding layout",
                       description=__doc__.splitlines()[0])
    add_config_args(p, default_preset="k3-2.8t")
    p.add_argument("--layout", choices=("train", "generate"), default="train")
    p.add_argument("--mesh", default=None,
                   help="axis sizes, e.g. data=2,fsdp=16,expert=64 (default: the preset's "
                        "layout); -1 takes the rest of --devices")
    add_layout_args(p)
    p.add_argument("--devices", type=positive_int, default=None,
                   help="device count, to resolve a -1 in --mesh or the preset default")
    p.add_argument("--device-memory", default=None,
                   help="memory per device (default: the --topology chip's HBM with --compile, "
                        "else 141GiB)")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="global batch (train: sequences per step; generate: concurrent "
                        "sequences); default: the data-parallel degree")
    p.add_argument("--accum-steps", type=positive_int, default=1,
                   help="train: micro-batches per step (train.accum_steps); activations are "
                        "one micro-batch's, --batch / --accum-steps sequences")
    p.add_argument("--seq", type=positive_int, default=8192,
                   help="tokens per sequence (generate: the context the caches hold)")
    p.add_argument("--prefill-chunk", type=positive_int, default=4096)
    p.add_argument("--moe-capacity-factor", type=positive_float, default=None)
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="train: the optimizer state counted (Muon: one momentum per matrix "
                        "element, AdamW's two for the rest) and compiled")
    p.add_argument("--platform", choices=("tpu", "gpu"), default=None,
                   help="generate: the caches as the engine lays them out there (TPU: rows "
                        "padded to 128 lanes); default: tpu with --compile, else unpadded")
    p.add_argument("--paged", action="store_true",
                   help="with --layout generate --compile: compile the steps on the paged "
                        "cache (the server's default: --batch x the pages of --seq, one "
                        "partition per batch device group) instead of dense slots")
    p.add_argument("--compile", action="store_true",
                   help="also compile the layout's steps (train: the train step; generate: a "
                        "prefill chunk and a decode step) for --topology with XLA:TPU (libtpu) "
                        "and compare their memory with the estimate")
    p.add_argument("--topology", default=None, metavar="NAME",
                   help="TPU topology for --compile, e.g. v5e:2x2, v5p:8x8x16, v6e:16x16 "
                        "(its device count must equal the mesh's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from kdsa.sharding.mesh import AXES, layout_sizes, resolve_sizes
    from kdsa.sharding.plan import format_plan, make_plan
    from kdsa.sharding.rules import get_rules

    if args.compile and args.topology is None:
        raise ValueError("--compile needs --topology NAME (e.g. v5e:2x2, v5p:8x8x16)")
    if args.paged and not (args.compile and args.layout == "generate"):
        raise ValueError("--paged compiles the generate steps on the paged cache: add "
                         "--layout generate --compile --topology NAME")
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
        batch = _prod(sizes[a] for a in (get_rules(args.layout)["act_batch"] or ())) * (
            args.accum_steps if args.layout == "train" else 1)  # one row per device per pass
    hbm = _device_memory(args)
    tpu = args.platform == "tpu" or (args.platform is None and args.compile)
    plan = make_plan(config, args.layout, sizes, device_memory=hbm,
                     batch=batch, seq=args.seq, prefill_chunk=args.prefill_chunk,
                     moe_capacity_factor=args.moe_capacity_factor,
                     accum_steps=args.accum_steps, optimizer_moments=_moments(args.optimizer),
                     rope_lanes=128 if tpu else None)
    compiled, refused = _compile(args, config, sizes, batch) if args.compile else ({}, {})
    if args.json:
        out = plan.to_json()
        for step, c in compiled.items():
            out.setdefault("compiled", {})[step] = {**c.to_dict(), "device_memory": hbm,
                                                    "fits": c.peak <= hbm}
        for step, why in refused.items():
            out.setdefault("compiled", {})[step] = {"refused_by_xla": why, "fits": False}
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan, name))
        for step, c in compiled.items():
            print(_format_compiled(step, c, plan, hbm, args.topology))
        for step, why in refused.items():
            print(f"REFUSED: XLA:TPU would not compile the {step} for {args.topology}: {why}")
    if refused or any(c.peak > hbm for c in compiled.values()):
        return 3
    return 0 if plan.fits else 3


def _moments(optimizer: str):
    """Optimizer state elements per trainable element, by parameter (``make_plan``)."""
    if optimizer == "adamw":
        return None  # AdamW's two moments everywhere
    from kdsa.sharding.rules import variable_axes
    from kdsa.train.optim import matrix_dims

    return lambda path, var: 1 if matrix_dims(
        tuple(getattr(k, "key", k) for k in path), variable_axes(var), var.ndim) else 2


def _device_memory(args) -> int:
    """``--device-memory``, else the ``--topology`` chip's HBM under ``--compile``, else 141 GiB."""
    from kdsa.sharding.plan import parse_bytes
    from kdsa.sharding.aot import chip_hbm

    if args.device_memory is not None:
        return parse_bytes(args.device_memory)
    if args.compile and chip_hbm(args.topology) is not None:
        return chip_hbm(args.topology)
    return parse_bytes("141GiB")


def _compile(args, config, sizes, batch) -> tuple[dict, dict]:
    """``({step: CompiledMemory}, {step: why XLA refused it})`` for the layout's steps on
    ``--topology``. XLA:TPU itself refuses a program whose temporaries exceed the chip's HBM
    ("RESOURCE_EXHAUSTED ... CompileTimeHbmOom"): that is an answer (it does not fit), not a
    crash; every other compile error propagates."""
    import jax

    from kdsa.infer.aot import generate_step_compiles
    from kdsa.train.aot import compile_train_step
    from kdsa.train.config import TrainConfig

    if args.layout == "generate":
        steps = generate_step_compiles(config, args.topology, sizes, slots=batch,
                                       max_len=args.seq,
                                       prefill_chunk=min(args.prefill_chunk, args.seq),
                                       paged=args.paged)
    else:
        steps = {"train step": lambda: compile_train_step(
            config, TrainConfig(steps=1, batch_size=batch, accum_steps=args.accum_steps,
                                optimizer=args.optimizer),
            args.topology, sizes, batch=batch, seq=args.seq,
            moe_capacity_factor=args.moe_capacity_factor)}
    compiled, refused = {}, {}
    for name, compile_step in steps.items():
        try:
            compiled[name] = compile_step()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e) or "HBM" not in str(e):
                raise  # (the host running out of memory while compiling is not an answer)
            refused[name] = str(e).splitlines()[0]
    return compiled, refused


def _format_compiled(step: str, c, plan, hbm: int, topology: str) -> str:
    gib = 1 << 30
    rows = [("arguments", c.arguments), ("outputs", c.outputs), ("aliased", -c.aliased),
            ("temporaries", c.temporaries), ("code", c.code)]
    lines = [f"compiled {step} for {topology} in {c.compile_seconds:.1f} s (XLA:TPU, per "
             f"device)", f"{'':<24}{'GiB':>12}"]
    lines += [f"  {k:<22}{v / gib:>12,.3f}" for k, v in rows if v]
    lines.append(f"  {'PEAK':<22}{c.peak / gib:>12,.3f}   of {hbm / gib:,.2f} "
                 f"({100 * c.peak / hbm:.0f}%); the estimate above: {plan.total / gib:,.3f} "
                 f"({c.peak / max(plan.total, 1):.1f}x)")
    lines.append("  collectives: " + (", ".join(f"{op} x{n}" for op, n in c.collectives.items())
                                      or "none"))
    if c.kernels:
        lines.append("  Pallas kernels: " + ", ".join(f"{k} x{n}" for k, n in c.kernels.items()))
    lines.append("compiled program fits" if c.peak <= hbm else
                 f"REFUSED: the compiled program needs {c.peak / gib:,.2f} GiB per device > "
                 f"{hbm / gib:,.2f} GiB")
    return "\n".join(lines)


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out
