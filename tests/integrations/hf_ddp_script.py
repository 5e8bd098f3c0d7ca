"""DMSTrainer under torchrun on CPU (gloo): run by test_hf_trainer.py as
``torchrun --nproc_per_node 2 hf_ddp_script.py OUT_DIR``; each rank writes OUT_DIR/rank{r}.json."""

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


def main(out: str, variant: str = "width") -> None:
    """``variant``: "width" (depth not searched) or "depth" (depth searched and frozen half-way),
    at the Trainer's defaults; "-checkpointing" appended: with activation checkpointing (for which
    the Trainer would build DDP without ``find_unused_parameters``); "-no-unused": with
    ``ddp_find_unused_parameters=False``."""
    model = tiny_llama()
    depth = variant.startswith("depth")
    extra: dict = {"ddp_find_unused_parameters": False} if variant.endswith("-no-unused") else {}
    if variant.endswith("-checkpointing"):
        extra["gradient_checkpointing"] = True
    example = {"input_ids": torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))}
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, "run"), max_steps=6, per_device_train_batch_size=4,
        learning_rate=1e-3, report_to=[], save_strategy="no", logging_steps=3, use_cpu=True,
        disable_tqdm=True, seed=0, ddp_backend="gloo", gradient_accumulation_steps=2, **extra)
    trainer = DMSTrainer(
        model=model, args=args, train_dataset=RandomTokens(),
        search_config=dms.SearchConfig(resource="params", target=0.6, layer_uniform=True, search_depth=depth,
                                       width_only_from=0.5 if depth else None,
                                       exclude=["model.embed_tokens"]),
        example_inputs=example, structure_lr=0.05, export_dir=os.path.join(out, "found"))
    trainer.train()
    searcher = trainer.searcher
    rank = int(os.environ.get("RANK", 0))
    wrapped = trainer.model_wrapped
    find_unused = getattr(wrapped, "find_unused_parameters", None)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"world": int(os.environ.get("WORLD_SIZE", 1)), "wrapped": type(wrapped).__name__,
                   "find_unused": find_unused,
                   "a": [float(v) for p in searcher.structure_parameters() for v in p.detach().reshape(-1)],
                   "structure": searcher.structure(),
                   "has_sync": hasattr(searcher, "sync_importance"),
                   "depth_frozen": searcher.gates.depth_frozen,
                   "soft": searcher.resources()["soft"] / searcher.supernet_cost}, f)


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
