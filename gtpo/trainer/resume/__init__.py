"""Resume: which checkpoint a run continues from whatever instant the last attempt was killed at (``checkpoints``),
the recipe's own state saved with each checkpoint (``checkpoint_state``), a checkpoint of another world size
resharded or refused before any worker loads (``checkpoint_world_size``, ``reshard``, ``reshard_shards``; also
``python -m gtpo.trainer.resume.reshard``), and how many checkpoints the disk keeps.
"""
