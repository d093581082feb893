"""Checks a ``kdsa rl`` run makes before it builds or compiles anything, and its environments.

``check_rl_configs`` cross-checks the model, train and RL configs (and the tokenizer's ids
against the vocabulary) so a bad combination is one line before minutes of compiling;
``build_envs`` makes the configured environments, refusing a domain named twice.
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


def check_rl_configs(config: ModelConfig, tc: TrainConfig, rc: RLConfig,
                     tokenizer_path: str | Path | None = None) -> None:
    """Every cross-check before anything is built or compiled (``tokenizer_path``: the
    model's own tokenizer, else the byte tokenizer)."""
    if config.context_limit is not None and rc.seq_len + 1 > config.context_limit:
        raise ValueError(f"rl.seq_len={rc.seq_len} exceeds max_position_embeddings="
                         f"{config.context_limit}")
    if tc.indexer_stage != "none":
        raise ValueError("kdsa rl trains all parameters: train.indexer_stage must be 'none'")
    if config.expert_weight_format == "mxfp4":
        raise ValueError("MXFP4 routed experts are frozen bytes: RL needs "
                         "expert_weight_format='bf16'")
    rc.rows_per_micro_batch(tc.accum_steps)  # rows split into mini- and micro-batches
    if tokenizer_path is not None:  # its ids fit the vocabulary, the format's specials exist
        get_format(rc.chat_format, load_tokenizer(tokenizer_path, vocab_size=config.vocab_size))
    elif config.vocab_size < 384:
        raise ValueError(f"the byte tokenizer with chat specials needs vocab_size >= 384, got "
                         f"{config.vocab_size}")
    if rc.generate_devices > jax.local_device_count():
        raise ValueError(f"rl.generate_devices={rc.generate_devices} but only "
                         f"{jax.local_device_count()} local devices")
    build_envs(rc)  # unknown environments / bad options fail here


def build_envs(rc: RLConfig, seed: int = 0):
    """``({domain: env}, {domain: weight})`` from ``rc.envs``."""
    envs, weights = {}, {}
    for spec in rc.envs:
        env = make_env(spec.name, seed=seed, **spec.options)
        if env.domain in envs:
            raise ValueError(f"rl.envs names the domain {env.domain!r} twice")
        envs[env.domain], weights[env.domain] = env, spec.weight
    return envs, weights
