"""kdsa.train: the training loop (``trainer``, one step core in ``step``), checkpoints, data,
RL (``rl/``) and checkpoint conversion (``convert*``, ``mappings/``).

Entry points are the ``kdsa train`` / ``kdsa rl`` / ``kdsa convert`` commands; from Python,
``trainer.run_training``, ``rl.loop.run_rl`` and ``convert.hf_to_orbax`` / ``orbax_to_hf``.
"""
