"""Thin adapters between dmscale and other libraries' engines (imported on demand).

* :mod:`dmscale.integrations.ultralytics`: YOLO supernets from Ultralytics' yaml (with
  ``--expand``), deployable ``yolo.pt`` checkpoints of pruned models, and
  :class:`~dmscale.integrations.ultralytics.PrunedDetectionTrainer` to finetune them at
  their pruned size.
* :mod:`dmscale.integrations.hf_trainer`: :class:`~dmscale.integrations.hf_trainer.DMSTrainer`,
  a ``transformers.Trainer`` running a DMS search and saving a ``from_pretrained`` export
  (extra ``hf``).
* :mod:`dmscale.integrations.lightning`: :class:`~dmscale.integrations.lightning.DMSCallback`,
  a Lightning ``Callback`` doing the same for a ``LightningModule`` (extra ``lightning``).

Each imports its framework only when its class is first used.
"""

__all__: list[str] = []
