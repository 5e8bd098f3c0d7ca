"""DMSTrainer with accelerate's FSDP2 plugin on CPU (gloo): run by test_hf_trainer_fsdp.py as
``torchrun --nproc_per_node 2 hf_fsdp_script.py OUT_DIR fsdp``, and in one process as
``main(OUT_DIR, "one")`` (the same global batch, unsharded); each rank writes
OUT_DIR/<mode>-rank{r}.json and the export to OUT_DIR/found-<mode> (rank 0)."""

from __future__ import annotations

import json
import os
import sys

import torch

import dmscale as dms

dms.ensure_torchvision()
import transformers  # noqa: E402

from dmscale.integrations.hf_trainer import DMSTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_hf_trainer import VOCAB, RandomTokens, tiny_llama  # noqa: E402

MICRO_BATCH = 4  # the global micro-batch: 2 ranks x 2, or one process x 4


class CpuFSDPTrainer(DMSTrainer):
    """accelerate 1.15 enables its FSDP plugin only for accelerators (MULTI_GPU, MULTI_XPU, ...):
    on the CPU it drops the plugin and the Trainer runs DDP. Here FSDP is switched on after the
    Accelerator is built, with the plugin the Trainer made from ``fsdp_config``, so its FSDP2 code
    (``fsdp2_prepare_model``: fully_shard of the decoder layers, embeddings, head and root; the
    optimizer's parameters swapped; full state dicts for saving) runs on gloo."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.args.fsdp_plugin_args is not None and not self.is_fsdp_enabled:
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

            state = self.accelerator.state
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            state.distributed_type = DistributedType.FSDP
            self.is_fsdp_enabled = True


def main(out: str, mode: str) -> dict:
    """``mode``: "fsdp" (2 ranks, 2 sequences each per micro-batch) or "one" (one process, 4);
    two micro-batches per step either way. Returns what it writes to OUT_DIR/<mode>-rank{r}.json."""
    world = int(os.environ.get("WORLD_SIZE", 1)) if mode == "fsdp" else 1
    rank = int(os.environ.get("RANK", 0)) if mode == "fsdp" else 0
    extra: dict = {"fsdp": True, "fsdp_config": {"version": 2}, "ddp_backend": "gloo"} if mode == "fsdp" else {}
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, f"run-{mode}"), max_steps=4, per_device_train_batch_size=MICRO_BATCH // world,
        gradient_accumulation_steps=2, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1.0, report_to=[], save_strategy="no", logging_steps=2, use_cpu=True,
        disable_tqdm=True, seed=0, dataloader_drop_last=True, **extra)
    example = {"input_ids": torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))}
    trainer = CpuFSDPTrainer(
        model=tiny_llama(), args=args, train_dataset=RandomTokens(),
        search_config=dms.SearchConfig(resource="params", target=0.6, layer_uniform=True, search_depth=False,
                                       exclude=["model.embed_tokens"]),
        example_inputs=example, structure_lr=0.05, export_dir=os.path.join(out, f"found-{mode}"))
    trainer.train()
    searcher = trainer.searcher
    from torch.distributed.fsdp import FSDPModule

    record = {"world": world, "sharded": isinstance(trainer.model, FSDPModule),
              "a": [float(v) for p in searcher.structure_parameters() for v in p.detach().reshape(-1)],
              "importance": [float(v) for b in searcher.gates.buffers() if b.is_floating_point()
                             for v in b.detach().reshape(-1)],
              "structure": searcher.structure()["width"],
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "found": trainer.found_model is not None}
    with open(os.path.join(out, f"{mode}-rank{rank}.json"), "w") as f:
        json.dump(record, f)
    return record


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
