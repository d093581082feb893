"""The one ``key=value`` override parser, for every frozen config (model, train, RL).

``--set num_hidden_layers=8``, ``--set linear_attn_config.num_heads=4`` (a field of a nested
config), ``--train-set learning_rate=1e-3``, ``--rl-set 'envs=["rg:chain_sum"]'``: the value is
parsed as JSON, else taken as a bare string (``bfloat16``); JSON lists become tuples (configs
are frozen and hashable). The config's own validation (``__post_init__``) then checks the
values, so a bad override fails with the same message as a bad config file.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TypeVar

T = TypeVar("T")


def _parse(raw: str):
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return raw  # a bare string such as bfloat16
    return tuple(value) if isinstance(value, list) else value


def apply_overrides(config: T, overrides: list[str], *, flag: str = "--set", prefix: str = "",
                    what: str = "") -> T:
    """``config`` (a frozen dataclass) with ``overrides`` applied. ``flag`` and ``what`` name
    the option and the config in errors; ``prefix`` (e.g. ``"train."``) may precede a key."""
    fields = {f.name for f in dataclasses.fields(config)}
    top: dict = {}
    nested: dict[str, dict] = {}
    kind = f"{what} config" if what else "config"
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        key = key.removeprefix(prefix)
        head, _, sub = key.partition(".")
        if head not in fields:
            choices = f"; choose from {sorted(fields)}" if len(fields) <= 40 else ""
            raise ValueError(f"{flag} {key}: unknown {kind} field {head!r}{choices}")
        if sub:
            parent = getattr(config, head)
            if not dataclasses.is_dataclass(parent) or sub not in {
                    f.name for f in dataclasses.fields(parent)}:
                raise ValueError(f"{flag} {key}: {head} has no field {sub!r}")
            nested.setdefault(head, {})[sub] = _parse(raw)
        else:
            top[head] = _parse(raw)
    for head, changes in nested.items():
        top[head] = dataclasses.replace(getattr(config, head), **changes)
    return dataclasses.replace(config, **top) if top else config
