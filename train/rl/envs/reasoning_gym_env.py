"""Any ``reasoning-gym`` task family as an environment, scored by the family's own verifier.

``make_env("rg:chain_sum", min_terms=2, max_terms=2)`` (or ``make_env("reasoning_gym",
family="chain_sum", ...)``): the options other than ``seed`` / ``size`` / ``system`` /
``rewrite`` go to
``reasoning_gym.create_dataset(family, seed=..., size=..., **options)``. Task ``i`` of a split is
entry ``i mod size`` of the dataset for that split's seed (train: ``seed``, held-out: ``seed +
HELDOUT_SEED_OFFSET``); reasoning-gym generates entry ``i`` from its seed and ``i``, so tasks are
reproducible and nothing is materialised. The reward is ``dataset.score_answer(answer=content,
entry=entry)`` (in ``[0, 1]``) on the answer's content (the reasoning is not scored). The
reference answer (``entry["answer"]``) is the SFT demonstration.

``rewrite=[PATTERN, REPLACEMENT]`` (``re.sub``, applied once to the question) shortens a
family's long fixed instruction for small models and short sequences, e.g. ``["^State the final
answer to the following arithmetic problem: ", ""]``; the entry and its verifier are unchanged,
and a pattern that does not match the first task is an error (a typo would silently do nothing).
"""

from __future__ import annotations

import re

from kdsa.infer.chat import AssistantOutput, Message
from kdsa.train.rl.envs.base import (HELDOUT_SEED_OFFSET, Environment, Outcome, Task,
                                      register_env)


@register_env("reasoning_gym")
class ReasoningGymEnv(Environment):
    def __init__(self, *, family: str, seed: int = 0, size: int = 100_000,
                 system: str | None = None, rewrite: list | None = None, **options):
        super().__init__(seed=seed)
        import reasoning_gym as rg

        if not family:
            raise ValueError("reasoning_gym environment needs a family (rg:FAMILY)")
        if not isinstance(size, int) or not 1 <= size <= HELDOUT_SEED_OFFSET:
            # reasoning-gym builds entry i from seed + i: past the offset, train entries would
            # be the held-out split's
            raise ValueError(f"environment {self.name!r}: size must be an integer in [1, "
                             f"{HELDOUT_SEED_OFFSET}] (entry i is drawn from seed + i, and "
                             f"the held-out split starts at seed + {HELDOUT_SEED_OFFSET}), "
                             f"got {size!r}")
        self.family, self.size, self.system = family, size, system
        self.domain = f"rg:{family}"
        self._datasets = {}
        self.rewrite = None
        if rewrite is not None:
            if not (isinstance(rewrite, (list, tuple)) and len(rewrite) == 2 and all(
                    isinstance(x, str) for x in rewrite)):
                raise ValueError(f"rg:{family}: rewrite must be [pattern, replacement], got "
                                 f"{rewrite!r}")
            try:
                self.rewrite = (re.compile(rewrite[0]), rewrite[1])
            except re.error as e:
                raise ValueError(f"rg:{family}: rewrite pattern {rewrite[0]!r}: {e}") from None
        try:
            for split in ("train", "heldout"):
                self._datasets[split] = rg.create_dataset(family, seed=self.split_seed(split),
                                                          size=size, **options)
        except (ValueError, TypeError, AssertionError, KeyError) as e:
            raise ValueError(f"reasoning-gym family {family!r} with options {options}: "
                             f"{type(e).__name__}: {e}") from None
        if self.rewrite is not None and not self.rewrite[0].search(
                self._datasets["train"][0]["question"]):
            raise ValueError(f"rg:{family}: rewrite pattern {rewrite[0]!r} does not match the "
                             f"question {self._datasets['train'][0]['question']!r}")

    def task(self, index: int, split: str = "train") -> Task:
        self.split_seed(split)  # validates the split name
        ds = self._datasets[split]
        entry = ds[index % self.size]
        q = entry["question"]
        if self.rewrite is not None:
            q = self.rewrite[0].sub(self.rewrite[1], q, count=1)
        msgs = ([Message("system", self.system)] if self.system else []) + [Message("user", q)]
        return Task(self.domain, index, tuple(msgs), data=(split, index % self.size))

    def _entry(self, task: Task):
        split, i = task.data
        return self._datasets[split], self._datasets[split][i]

    def respond(self, task: Task, output: AssistantOutput, history) -> Outcome:
        ds, entry = self._entry(task)
        answer = output.content.strip()
        reward = float(ds.score_answer(answer=answer or None, entry=entry))
        return Outcome(reward=reward, metrics={"correct": float(reward >= 1.0)})

    def demonstration(self, task: Task) -> list[Message]:
        _, entry = self._entry(task)
        return [Message("assistant", str(entry["answer"]), reasoning="")]
