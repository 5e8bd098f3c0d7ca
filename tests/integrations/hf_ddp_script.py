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


def main(out: str) -> None:
    model = tiny_llama()
    example = {"input_ids": torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))}
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, "run"), max_steps=6, per_device_train_batch_size=4,
        learning_rate=1e-3, report_to=[], save_strategy="no", logging_steps=3, use_cpu=True,
        disable_tqdm=True, seed=0, ddp_backend="gloo", gradient_accumulation_steps=2)
    trainer = DMSTrainer(
        model=model, args=args, train_dataset=RandomTokens(),
        search_config=dms.SearchConfig(resource="params", target=0.6, layer_uniform=True, search_depth=False,
                                       exclude=["model.embed_tokens"]),
        example_inputs=example, structure_lr=0.05, export_dir=os.path.join(out, "found"))
    trainer.train()
    searcher = trainer.searcher
    rank = int(os.environ.get("RANK", 0))
    wrapped = type(trainer.model_wrapped).__name__
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"world": int(os.environ.get("WORLD_SIZE", 1)), "wrapped": wrapped,
                   "a": [float(p.detach()) for p in searcher.structure_parameters()],
                   "structure": searcher.structure(),
                   "has_sync": hasattr(searcher, "sync_importance"),
                   "soft": searcher.resources()["soft"] / searcher.supernet_cost}, f)


if __name__ == "__main__":
    main(sys.argv[1])
