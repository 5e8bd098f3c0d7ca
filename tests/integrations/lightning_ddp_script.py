"""DMSCallback under torchrun on CPU (gloo): run by test_lightning.py as
``torchrun --nproc_per_node 2 lightning_ddp_script.py OUT_DIR STRATEGY``; each rank writes
OUT_DIR/rank{r}.json. The network has residual blocks, so depth is searched, and the search
freezes depth half-way (``width_only_from=0.5``): from then on depth's ``a`` gets no gradient."""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

import dmscale as dms

dms.ensure_torchvision()
import lightning as L  # noqa: E402

from dmscale.integrations.lightning import DMSCallback  # noqa: E402
from torchrun_util import leave_process_group  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_lightning import Classifier  # noqa: E402


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)  # (B, 16)


class ResidualClassifier(Classifier):
    """test_lightning's module (AdamW over self.parameters()) around residual blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 16), Residual(), Residual(), Residual(), nn.Linear(16, 4))


class WrapProbe(L.Callback):
    """What the strategy wrapped the module in, seen while training."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.wrapped = trainer.strategy.model
        self.find_unused = getattr(self.wrapped, "find_unused_parameters", None)


def main(out: str, strategy: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(320, 16, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].argmax(1)), batch_size=16)
    dms_cb = DMSCallback(search_config=dms.SearchConfig(resource="params", target=0.5, width_only_from=0.5),
                         example_inputs=torch.randn(2, 16), submodule="net", structure_lr=0.05,
                         export_dir=os.path.join(out, "found"))
    trainer = L.Trainer(max_steps=8, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[dms_cb, probe := WrapProbe()])
    trainer.fit(ResidualClassifier(), loader)
    searcher = dms_cb.searcher
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"world": trainer.world_size, "wrapped": type(probe.wrapped).__name__,
                   "find_unused": probe.find_unused,
                   "a": [float(v) for p in searcher.structure_parameters() for v in p.detach().reshape(-1)],
                   "depth_frozen": searcher.gates.depth_frozen,
                   "structure": searcher.structure()}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
    leave_process_group()  # (alive at exit, the sharded module aborted a rank now and then)
