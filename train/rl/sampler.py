"""The RL job's generation side: a runner and engine on the generate mesh that the train state's
weights are resharded onto every step (``Sampler``), and the held-out evaluation on it."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from kdsa.infer.budget import BudgetConfig
from kdsa.infer.chat import get_format
from kdsa.infer.engine import Engine
from kdsa.infer.runner import ModelRunner
from kdsa.infer.tokenizer import load_tokenizer
from kdsa.model.config import ModelConfig
from kdsa.sharding.mesh import make_mesh
from kdsa.sharding.reshard import reshard_state
from kdsa.train.rl import rollout as ro
from kdsa.train.rl.config import RLConfig
from kdsa.train.rl.multihost import play_split


class Sampler:
    """The generation side: runner + engine on the generate mesh; ``sync`` reshards weights."""

    def __init__(self, model, config: ModelConfig, rc: RLConfig, seed: int,
                 tokenizer_path: str | Path | None = None):
        # the first devices by id: those the weight sync gathers onto (sharding/reshard.py)
        self.mesh = make_mesh({"data": -1}, devices=sorted(
            jax.local_devices(), key=lambda d: d.id)[:rc.generate_devices])
        self.tok = load_tokenizer(tokenizer_path, vocab_size=config.vocab_size,
                                  flavor="k2" if rc.chat_format == "k2" else "k3")
        self.fmt = get_format(rc.chat_format, self.tok)
        self.runner = ModelRunner(model, num_slots=rc.num_slots, max_len=rc.seq_len + 1,
                                  prefill_chunk=rc.seq_len + 1, min_bucket=rc.seq_len + 1,
                                  mesh=self.mesh, layout="generate",
                                  record_routing=rc.routing_replay)
        self.engine = Engine(self.runner, self.tok, chat_format=self.fmt,
                             budgets=BudgetConfig(caps=dict(rc.reasoning_caps), grace=0),
                             max_top_logprobs=0, seed=seed)

    def sync(self, graphdef, state) -> float:
        """Train state -> generate layout -> runner; returns the reshard seconds."""
        model_state = nnx.state(nnx.merge(graphdef, state.params, state.rest))
        moved, report = reshard_state(model_state, self.mesh, "generate")
        self.runner.state = moved
        return report.seconds


def evaluate(sampler: Sampler, envs, rc: RLConfig, seed: int) -> tuple[float, dict, list]:
    """Held-out reward: ``heldout_tasks`` fixed held-out tasks per domain, effort levels in
    turn, ``heldout_samples`` samples each at the rollout temperature; the mean environment
    reward (a truncated episode counts 0), the same per domain, and the episodes."""
    levels = [k for k, w in rc.effort_weights.items() if w > 0]
    tasks = [(env.task(i, "heldout"), levels[i % len(levels)])
             for env in envs.values() for i in range(rc.heldout_tasks)]
    g = rc.heldout_samples
    eps = ro.start_episodes(sampler.fmt, tasks, g)
    groups, _ = play_split(lambda e, **kw: ro.play(sampler.engine, sampler.fmt, envs, e, **kw),
                           [eps[i:i + g] for i in range(0, len(eps), g)], rc=rc, seed=seed)
    eps = [e for grp in groups for e in grp]  # multi-host: every process's share
    score = {id(e): 0.0 if e.truncated else e.score for e in eps}
    by_domain = {d: float(np.mean([score[id(e)] for e in eps if e.task.env == d])) for d in envs}
    return float(np.mean(list(score.values()))), by_domain, eps
