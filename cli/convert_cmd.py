"""``kdsa convert``: Hugging Face safetensors <-> kdsa Orbax checkpoints (``train/convert/pipeline.py``)."""

from __future__ import annotations

import re

from kdsa.cli.paths import abs_path


def register(sub) -> None:
    from kdsa.cli.config_args import add_config_args

    p = sub.add_parser("convert", help="convert checkpoints (hf-to-orbax, orbax-to-hf)",
                       description="Stream a checkpoint between Hugging Face safetensors "
                                   "(kimi_k3, kimi_linear, deepseek_v32 layouts) and kdsa's "
                                   "Orbax format. Output is written to a temporary directory "
                                   "and renamed when complete. An existing DST is replaced "
                                   "only with --overwrite, and only if it is a kdsa model "
                                   "folder or a Hugging Face checkpoint folder; DST may never "
                                   "be SRC, contain it or lie inside it.")
    conv = p.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    a = conv.add_parser("hf-to-orbax", help="HF directory -> Orbax checkpoint")
    a.add_argument("src", type=abs_path,
                   help="HF directory: config.json + *.safetensors (+ index)")
    a.add_argument("dst", type=abs_path,
                   help="Orbax checkpoint directory to create (an existing one needs "
                        "--overwrite)")
    add_config_args(a, default_preset=None)
    a.add_argument("--experts", choices=("mxfp4", "bf16"), default=None,
                   help="routed-expert storage in the model (default: as in the source)")
    a.add_argument("--layout", choices=("kimi_k3", "kimi_linear", "deepseek_v32"),
                   default=None, help="source layout (default: detected)")
    a.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                   help="place each tensor in its target sharding on this mesh, e.g. "
                        "fsdp=4,expert=2 (axes: data, fsdp, expert, tensor, sequence)")
    a.add_argument("--batch-size", default="1GB", help="bytes per Orbax write batch (1GB)")
    a.add_argument("--seed", type=int, default=0, help="seed of freshly initialised tensors")
    a.add_argument("--allow-partial", action="store_true",
                   help="allow a config with fewer layers than the source (converts the first "
                        "ones, with a warning); refused without it")
    _common(a)
    b = conv.add_parser("orbax-to-hf", help="Orbax checkpoint -> HF directory")
    b.add_argument("src", type=abs_path, help="kdsa Orbax checkpoint directory")
    b.add_argument("dst", type=abs_path,
                   help="HF directory to create (an existing one needs --overwrite)")
    b.add_argument("--experts", choices=("mxfp4", "bf16"), default=None,
                   help="routed-expert tensors to write (default: as stored)")
    b.add_argument("--layout", choices=("kimi_k3", "kimi_linear", "deepseek_v32"),
                   default=None, help="tensor names to write (default: the source layout)")
    b.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None,
                   help="dtype of float tensors (default: the dtypes recorded from the source "
                        "when exporting in its layout, else the config's param_dtype; "
                        "docs/conversion.md)")
    b.add_argument("--max-shard-size", default="5GB", help="cap per safetensors file (5GB)")
    _common(b)
    p.set_defaults(run=run)


def _common(p) -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="validate names, shapes and dtypes; write nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing DST (only a kdsa model folder or a Hugging Face "
                        "checkpoint folder; never SRC or a folder holding it)")


def parse_size(text: str, flag: str = "size") -> int:
    """``"5GB"`` / ``"500MB"`` / ``"1GiB"`` / ``"123"`` -> bytes; errors name ``flag``."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?)B?\s*", str(text),
                     re.IGNORECASE)
    if not m:
        raise ValueError(f"{flag}: cannot read size {text!r} (e.g. 5GB, 500MB, 1GiB)")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    size = int(float(m.group(1)) * base ** power)
    if size < 1:
        raise ValueError(f"{flag}: size {text!r} must be positive")
    return size


def run(args) -> int:
    from kdsa.cli.config_args import config_from_args
    from kdsa.model.overrides import apply_overrides
    from kdsa.train import convert

    if args.direction == "orbax-to-hf":
        s = convert.orbax_to_hf(args.src, args.dst, experts=args.experts, layout=args.layout,
                                dtype=args.dtype, max_shard_bytes=parse_size(args.max_shard_size, "--max-shard-size"),
                                dry_run=args.dry_run, progress=not args.no_progress,
                                overwrite=args.overwrite)
        print(s.format())
        return 0
    config = None
    if args.preset or args.config:
        _, config = config_from_args(args)
    elif args.overrides:
        from pathlib import Path

        from kdsa.train.convert.mappings import detect_layout
        from kdsa.train.convert.safetensors_io import SafetensorsCheckpoint

        hf = convert.read_hf_config(Path(args.src))
        layout = args.layout or detect_layout(hf, SafetensorsCheckpoint(args.src).names())
        config = apply_overrides(convert.config_from_hf(hf, layout=layout), args.overrides)
    mesh = None
    if args.mesh:
        from kdsa.sharding.mesh import make_mesh

        mesh = make_mesh(args.mesh)
    s = convert.hf_to_orbax(args.src, args.dst, config=config, experts=args.experts, mesh=mesh,
                            layout=args.layout, dry_run=args.dry_run,
                            progress=not args.no_progress, seed=args.seed,
                            batch_bytes=parse_size(args.batch_size, "--batch-size"), overwrite=args.overwrite,
                            allow_partial=args.allow_partial)
    print(s.format())
    return 0
