"""RL environments: the registry, reasoning-gym families, a multi-turn tool-use task, mixing."""

from kdsa.train.rl.envs.base import (Environment, Outcome, Task, make_env, register_env,
                                     registered_envs)

__all__ = ["Environment", "Outcome", "Task", "make_env", "register_env", "registered_envs"]
