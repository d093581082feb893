"""kdsa.sharding: meshes, the rules table, placement, resharding and memory plans.

It places what the model computes: ``mesh.make_mesh``, ``rules`` (logical name -> mesh axes
per layout; ``shard_model``, ``state_shardings``, ``layout_shardings``),
``constrain.use_sharding`` (activates a layout for the model's ``partitioning`` calls),
``reshard`` (train <-> generate weights), ``train_state`` (optimizer state and batches),
``plan`` (``kdsa plan``), ``distributed`` (multi-process start-up). It imports the model,
never the trainer, the engine or the CLI.
"""
