"""Reinforcement learning: environments, rollouts from the generation engine, the RL loop."""
