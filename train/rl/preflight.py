"""Checks a ``kdsa rl`` run makes before it builds or compiles anything, and its environments.

``check_rl_configs`` cross-checks the model, train and RL configs (and the tokenizer's ids
against the vocabulary) so a bad combination is one line before minutes of compiling;
``build_envs`` makes the configured environments, refusing a domain named twice;
``check_prompt_lengths`` measures their prompts against ``rl.seq_len``.
"""

from __future__ import annotations

from pathlib import Path

import jax

from kdsa.infer.chat import get_format
from kdsa.infer.tokenizer import load_tokenizer
from kdsa.model.config import ModelConfig
from kdsa.train.config import TrainConfig
from kdsa.train.rl.config import RLConfig
from kdsa.train.rl.envs.base import make_env
from kdsa.train.rl.rollout import render_prompt

PROMPT_SAMPLES = 16  # training tasks per environment whose prompts the preflight renders


def check_rl_configs(config: ModelConfig, tc: TrainConfig, rc: RLConfig,
                     tokenizer_path: str | Path | None = None, log=None) -> None:
    """Every cross-check before anything is built or compiled (``tokenizer_path``: the
    model's own tokenizer, else the byte tokenizer); ``log(message)`` takes the warnings."""
    if config.context_limit is not None and rc.seq_len + 1 > config.context_limit:
        raise ValueError(f"rl.seq_len={rc.seq_len} exceeds max_position_embeddings="
                         f"{config.context_limit}")
    if tc.indexer_stage != "none":
        raise ValueError("kdsa rl trains all parameters: train.indexer_stage must be 'none'")
    if config.expert_weight_format == "mxfp4":
        raise ValueError("MXFP4 routed experts are frozen bytes: RL needs "
                         "expert_weight_format='bf16'")
    rc.rows_per_micro_batch(tc.accum_steps)  # rows split into mini- and micro-batches
    if tokenizer_path is None and config.vocab_size < 384:
        raise ValueError(f"the byte tokenizer with chat specials needs vocab_size >= 384, got "
                         f"{config.vocab_size}")
    # the model's own tokenizer: its ids fit the vocabulary, the format's specials exist
    fmt = get_format(rc.chat_format, load_tokenizer(
        tokenizer_path, vocab_size=config.vocab_size,
        flavor="k2" if rc.chat_format == "k2" else "k3"))  # as the sampler loads it
    if rc.generate_devices > jax.local_device_count():
        raise ValueError(f"rl.generate_devices={rc.generate_devices} but only "
                         f"{jax.local_device_count()} local devices")
    envs, _ = build_envs(rc)  # unknown environments / bad options fail here
    check_prompt_lengths(envs, fmt, rc, log)


def check_prompt_lengths(envs: dict, fmt, rc: RLConfig, log=None) -> None:
    """Each environment's first :data:`PROMPT_SAMPLES` training prompts, rendered at the
    effort levels the run draws, against ``rl.seq_len``. A prompt that fills it leaves no room
    for the answer: its episode is cut before the model writes a token and scored
    ``-truncation_penalty``. Refused when no sampled prompt fits (every group would score the
    same and no step would update, without an error); otherwise ``log`` gets a warning naming
    the share that does not fit."""
    efforts = [k for k, w in rc.effort_weights.items() if w > 0]
    for domain, env in envs.items():
        lengths = [max(len(render_prompt(fmt, env.task(i), e)) for e in efforts)
                   for i in range(PROMPT_SAMPLES)]
        over = sum(n >= rc.seq_len for n in lengths)
        if over == len(lengths):
            raise ValueError(f"rl.seq_len={rc.seq_len} leaves no room to answer {domain!r}: its "
                             f"prompts take {min(lengths)}-{max(lengths)} tokens (the first "
                             f"{len(lengths)} tasks); raise rl.seq_len")
        if over and log is not None:
            log(f"warning: {over} of the first {len(lengths)} prompts of {domain!r} take "
                f"rl.seq_len={rc.seq_len} tokens or more (up to {max(lengths)}): such episodes "
                f"are cut before the answer and scored -truncation_penalty")


def build_envs(rc: RLConfig, seed: int = 0):
    """``({domain: env}, {domain: weight})`` from ``rc.envs``."""
    envs, weights = {}, {}
    for spec in rc.envs:
        env = make_env(spec.name, seed=seed, **spec.options)
        if env.domain in envs:
            raise ValueError(f"rl.envs names the domain {env.domain!r} twice")
        envs[env.domain], weights[env.domain] = env, spec.weight
    return envs, weights
