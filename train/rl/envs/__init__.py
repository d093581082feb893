"""RL environments: the registry, reasoning-gym families, a multi-turn tool-use task, image
prompts (``image_stripes``), mixing."""

from kdsa.train.rl.envs.base import (Environment, Outcome, Task, make_env, register_env,
                                     registered_envs)
from kdsa.train.rl.envs import image_stripes  # noqa: E402,F401  (registers image_stripes)

__all__ = ["Environment", "Outcome", "Task", "make_env", "register_env", "registered_envs"]
