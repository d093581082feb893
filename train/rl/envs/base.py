"""The environment interface and the registry (``register_env``, ``make_env``).

An environment is a source of verifiable tasks of one *domain* (its registered name). The RL
loop asks it for task ``index`` of a split (``"train"`` or ``"heldout"``; deterministic in
``(seed, split, index)``), renders the task's messages with the chat format, lets the policy
answer, and hands the parsed answer back to :meth:`Environment.respond`, which either ends the
episode with a reward or returns messages (tool results) for another assistant turn. Rewards
and per-domain metrics are logged under the environment's name.

Adding one (see ``docs/rl.md``)::

    @register_env("echo")
    class Echo(Environment):
        def task(self, index, split):
            word = ["cat", "dog"][index % 2]
            return Task(self.name, index, [Message("user", f"Say {word}.")], data=word)

        def respond(self, task, output, history):
            return Outcome(reward=float(output.content.strip() == task.data))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from kdsa.infer.chat import AssistantOutput, Message, Tool

SPLITS = ("train", "heldout")
HELDOUT_SEED_OFFSET = 1_000_003  # held-out tasks come from seed + this offset


@dataclasses.dataclass(frozen=True)
class Task:
    env: str  # the registered name of the environment (the domain)
    index: int
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    data: Any = None  # private to the environment (e.g. the reasoning-gym entry)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """``respond``'s answer: ``done`` with ``reward``, or more ``messages`` for another turn."""

    reward: float = 0.0
    done: bool = True
    messages: tuple[Message, ...] = ()  # tool results etc. appended before the next turn
    metrics: dict = dataclasses.field(default_factory=dict)  # per-domain extras (means logged)


class Environment:
    """Base class; subclasses implement :meth:`task` and :meth:`respond`.

    ``max_turns``: assistant turns per episode (1 for single-answer tasks). ``demonstration``
    (optional) gives a reference assistant turn for a task, used by the SFT warm-up.
    """

    name: str = "?"
    max_turns: int = 1

    def __init__(self, *, seed: int = 0, **kwargs):
        if kwargs:
            raise ValueError(f"environment {self.name!r}: unknown options {sorted(kwargs)}")
        self.seed = seed
        self.domain = self.name  # the metrics key; reasoning-gym: rg:FAMILY

    def split_seed(self, split: str) -> int:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self.seed + (HELDOUT_SEED_OFFSET if split == "heldout" else 0)

    def task(self, index: int, split: str = "train") -> Task:
        raise NotImplementedError

    def respond(self, task: Task, output: AssistantOutput,
                history: tuple[Message, ...]) -> Outcome:
        """Judge the assistant turn ``output``; ``history``: the messages after the task's own
        (earlier assistant turns and their tool results), so ``turn = #assistant in history``."""
        raise NotImplementedError

    def demonstration(self, task: Task) -> list[Message] | None:
        return None


_REGISTRY: dict[str, Callable[..., Environment]] = {}


def register_env(name: str):
    """Class decorator: ``@register_env("name")`` makes ``make_env("name", **options)`` work."""
    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"environment {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def registered_envs() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def make_env(name: str, **options) -> Environment:
    """An environment by registered name (``rg:FAMILY`` is the reasoning-gym family FAMILY)."""
    _load_builtins()
    if name.startswith("rg:"):
        return _REGISTRY["reasoning_gym"](family=name[3:], **options)
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {sorted(_REGISTRY)} "
                         f"(or rg:FAMILY for a reasoning-gym task family)")
    return _REGISTRY[name](**options)


def _load_builtins() -> None:
    from kdsa.train.rl.envs import reasoning_gym_env, tool_use  # noqa: F401  (registers)
