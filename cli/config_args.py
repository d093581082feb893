"""``--preset NAME`` / ``--config FILE.json`` plus ``--set key=value`` for every command."""

from __future__ import annotations

import argparse
import json

from kdsa.cli.paths import abs_path
from kdsa.model.config import ModelConfig, get_preset
from kdsa.model.overrides import apply_overrides


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a size, a count), refused by name before any work."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a factor)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_config_args(p: argparse.ArgumentParser, default_preset: str | None = "tiny") -> None:
    g = p.add_argument_group("model config")
    from kdsa.model.presets import PRESETS

    g.add_argument("--preset", default=None,
                   help=f"named preset: {', '.join(sorted(PRESETS))} (default {default_preset})")
    g.add_argument("--config", type=abs_path, default=None,
                   help="a JSON config: Hugging Face config.json or one written by kdsa")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set hidden_size=128 "
                        "--set linear_attn_config.num_heads=4 (value parsed as JSON)")
    p.set_defaults(_default_preset=default_preset)


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """``--layouts FILE.json``: the mesh of each named layout (docs/sharding.md, "Layouts")."""
    p.add_argument("--layouts", type=abs_path, default=None, metavar="FILE.json",
                   help="JSON object of mesh axis sizes per layout, e.g. {\"train\": "
                        "{\"expert\": 2, \"fsdp\": -1}, \"generate\": \"data=2,tensor=2\"}; "
                        "a \"mesh\" object of the same form inside the --config file works "
                        "too. --mesh wins over this file, which wins over --config's section "
                        "and the preset's default")


def layout_override(args: argparse.Namespace, layout: str):
    """The mesh sizes a command uses for ``layout``, or None for the preset's default:
    ``--mesh`` > ``--layouts FILE`` > the ``mesh`` section of the ``--config`` file. Every
    section given is validated (``sharding.mesh.read_layouts``), used or not."""
    from kdsa.sharding.mesh import read_layouts

    found = []
    if getattr(args, "layouts", None) is not None:
        found.append(read_layouts(read_json_file(args.layouts, "--layouts"),
                                  f"--layouts {args.layouts}"))
    if getattr(args, "config", None) is not None:
        raw = read_json_file(args.config, "--config")
        if isinstance(raw, dict) and "mesh" in raw:
            found.append(read_layouts(raw["mesh"], f"--config {args.config}: mesh"))
    if getattr(args, "mesh", None):
        return args.mesh
    for section in found:
        if layout in section:
            return section[layout]
    return None


def config_from_args(args: argparse.Namespace) -> tuple[str, ModelConfig]:
    """The config named by the arguments, validated. Raises ValueError with a clear message."""
    if args.preset and args.config:
        raise ValueError("give either --preset or --config, not both")
    if args.config:
        hf = read_json_file(args.config, "--config")
        name, config = args.config.name, ModelConfig.from_hf_config(hf)
    else:
        name = args.preset or args._default_preset
        config = get_preset(name)
    return name, apply_overrides(config, args.overrides)


def read_json_file(path, flag: str):
    """The JSON value in ``path``; a missing file or bad JSON is a ValueError naming ``flag``."""
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {path}: not valid JSON ({e})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not UTF-8 text (a binary file?)") from None


def add_init_from_args(p: argparse.ArgumentParser) -> None:
    """``--init-from DIR`` and ``--export-experts`` (``kdsa train``, ``kdsa rl``)."""
    p.add_argument("--init-from", type=abs_path, default=None, metavar="DIR",
                   help="start from the weights of a kdsa model folder (kdsa convert "
                        "hf-to-orbax output, a run's RUN_DIR/model, or a training checkpoint); "
                        "the model config and tokenizer come from DIR, --set may change only "
                        "training fields (remat_policy, expert_qat, ...). MXFP4 experts are "
                        "dequantized for training (docs/post_training.md)")
    p.add_argument("--export-experts", choices=("bf16", "mxfp4"), default=None,
                   help="routed-expert format of RUN_DIR/model, written when the run "
                        "finishes (default: mxfp4 when --init-from holds MXFP4 experts, "
                        "else bf16)")


def model_from_args(args: argparse.Namespace) -> tuple[str, ModelConfig]:
    """``(name, config)``: ``--init-from DIR``'s training config (``train/init_from.py``) with
    the allowed ``--set`` overrides, or ``--preset`` / ``--config`` as usual."""
    if getattr(args, "init_from", None) is None:
        return config_from_args(args)
    if args.preset or args.config:
        raise ValueError(f"--init-from {args.init_from} brings its own model config; drop "
                         f"--preset/--config")
    from kdsa.model.checkpoint import read_info
    from kdsa.train.init_from import check_overrides, training_config

    stored, _ = read_info(args.init_from)
    check_overrides(args.init_from, args.overrides)
    return args.init_from.name, apply_overrides(training_config(stored), args.overrides)


def model_tokenizer(args: argparse.Namespace, config: ModelConfig):
    """The tokenizer in ``--init-from DIR`` (its ``tiktoken.model`` or ``tokenizer.json``),
    checked against the model's vocabulary; None (the byte tokenizer) without one."""
    from kdsa.infer.tokenizer import load_tokenizer
    from kdsa.train.init_from import tokenizer_folder

    folder = tokenizer_folder(getattr(args, "init_from", None))
    return None if folder is None else load_tokenizer(folder, vocab_size=config.vocab_size)
