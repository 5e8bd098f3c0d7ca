"""Thin adapters between dmscale and other libraries' engines (imported on demand).

* :mod:`dmscale.integrations.ultralytics`: YOLO supernets from Ultralytics' yaml (with
  ``--expand``), deployable ``yolo.pt`` checkpoints of pruned models, and
  :class:`~dmscale.integrations.ultralytics.PrunedDetectionTrainer` to finetune them at
  their pruned size.
"""

__all__: list[str] = []
