"""DMS inside a Lightning Trainer (dmscale.integrations.lightning): a tiny MLP, 10 steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmscale as dms

dms.ensure_torchvision()
L = pytest.importorskip("lightning")

from dmscale.integrations.lightning import DMSCallback  # noqa: E402


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


class Classifier(L.LightningModule):
    """A user's module as it is: AdamW over self.parameters() with a step LR schedule."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class GroupProbe(L.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[float, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        group = next(g for g in optimizer.param_groups if g.get("dms_structure"))
        self.seen.append((group["lr"], group["weight_decay"]))


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(160, 16, generator=g)
    y = (x[:, :4].argmax(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _trainer(*callbacks, **kw) -> L.Trainer:
    kw = {"max_steps": 10, **kw}
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), **kw)


def test_callback_searches_exports_and_saves(tmp_path, monkeypatch):
    # the factor of the settle phase reaches the user's optimizer (stubbed: 1, then 0.5 from half-way)
    monkeypatch.setattr(dms.Searcher, "structure_lr_scale", lambda self, p: 1.0 if p < 0.5 else 0.5)
    module = Classifier()
    dms_cb = DMSCallback(search_config=dms.SearchConfig(resource="params", target=0.5),
                         example_inputs=torch.randn(2, 16), submodule="net", structure_lr=0.05,
                         export_dir=tmp_path / "found")
    probe = GroupProbe()
    trainer = _trainer(dms_cb, probe, accumulate_grad_batches=1)
    trainer.fit(module, _loader())
    searcher = dms_cb.searcher

    # own group in the user's optimizer: own lr (times the settle phase's factor) (StepLR halves the weights' lr), no decay
    assert probe.seen == [(0.05, 0.0)] * 5 + [(0.025, 0.0)] * 5  # x structure_lr_scale (stubbed below)
    opt = trainer.optimizers[0]
    assert opt.param_groups[0]["lr"] < 1e-2 / 100  # the user's schedule still drives the weights
    ids = {id(p) for p in searcher.structure_parameters()}
    others = [p for g in opt.param_groups if not g.get("dms_structure") for p in g["params"]]
    assert not ids & {id(p) for p in others} and len(others) == len(list(mlp().parameters()))
    # the structural parameters moved, the resource loss was applied and the cost came down
    assert all(float(v) > 0.1 for p in searcher.structure_parameters() for v in p.detach().reshape(-1))
    assert len(dms_cb.resource_losses) == 10 and max(dms_cb.resource_losses) > 0  # 0 at step 0: r_t = supernet
    assert searcher.resources()["soft"] < 0.8 * searcher.supernet_cost
    # the export is physically smaller, within the budget, and reloads from the saved files
    small = dms_cb.found_model
    x = torch.randn(2, 16)
    assert dms.count(small, x)["params"] <= searcher.target_cost < dms.count(mlp(), x)["params"]
    again = dms.load(mlp(), tmp_path / "found")
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(x), small.eval()(x))


def test_callback_with_searcher_and_accumulation(tmp_path):
    module = Classifier()
    searcher = dms.prepare(module.net, torch.randn(2, 16), dms.SearchConfig(resource="macs", target=0.5))
    dms_cb = DMSCallback(searcher, structure_lr=0.05)
    trainer = _trainer(dms_cb, accumulate_grad_batches=2)
    trainer.fit(module, _loader())
    assert len(dms_cb.resource_losses) == 10  # once per optimizer step, not per micro-batch
    assert dms_cb.found_model is not None and not (tmp_path / "found").exists()


def test_callback_names_wrong_use():
    with pytest.raises(ValueError, match="example_inputs"):
        DMSCallback(search_config=dms.SearchConfig())
    other = mlp()
    searcher = dms.prepare(other, torch.randn(2, 16), dms.SearchConfig(resource="params", target=0.5))
    with pytest.raises(ValueError, match="not part of the fitted"):
        _trainer(DMSCallback(searcher)).fit(Classifier(), _loader())


@pytest.fixture
def own_process_group():
    """Lightning's DDP strategy starts a process group in this process and sets MASTER_ADDR,
    WORLD_SIZE, ... in the environment: both are undone afterwards."""
    import os

    saved = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def _depth_search_fit(strategy: str, module=None) -> tuple[DMSCallback, object]:
    """A residual network (depth is searched) fitted under ``strategy`` on one CPU process;
    the search freezes depth half-way, so depth's ``a`` gets no gradient from step 4 on."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lightning_ddp_script import ResidualClassifier, WrapProbe

    dms_cb = DMSCallback(search_config=dms.SearchConfig(resource="params", target=0.5, width_only_from=0.5),
                         example_inputs=torch.randn(2, 16), submodule="net", structure_lr=0.05)
    probe = WrapProbe()
    module = module if module is not None else ResidualClassifier()
    _trainer(dms_cb, probe, max_steps=8, devices=1, strategy=strategy).fit(module, _loader())
    return dms_cb, probe


def test_callback_under_ddp_with_depth_freezing(own_process_group):
    """strategy="ddp" builds DDP without find_unused_parameters; once depth is frozen its ``a``
    has no gradient and the next step failed ("Expected to mark a variable ready only once").
    The callback turns find_unused_parameters on before the strategy wraps the module."""
    dms_cb, probe = _depth_search_fit("ddp")
    assert type(probe.wrapped).__name__ == "DistributedDataParallel" and probe.find_unused is True
    assert dms_cb.searcher.gates.depth_frozen and dms_cb.found_model is not None
    assert len(dms_cb.resource_losses) == 8


def test_callback_refuses_ddp_told_not_to_find_unused(own_process_group):
    from lightning_ddp_script import ResidualClassifier

    module = ResidualClassifier()
    with pytest.raises(ValueError, match="strategy='ddp_find_unused_parameters_true'"):
        _depth_search_fit("ddp_find_unused_parameters_false", module)
    assert not hasattr(module.net, "dms_gates")  # refused before training: the module as it came
    from lightning.pytorch.strategies import DDPStrategy

    with pytest.raises(ValueError, match="static_graph=True"):
        _depth_search_fit(DDPStrategy(static_graph=True))


@pytest.mark.slow  # torchrun, two processes importing Lightning: about 30 s on 2 cores
def test_callback_under_torchrun_ddp_on_cpu(tmp_path):
    """Two ranks, depth frozen half-way: the same ratios and structure on both, rank 0 saves."""
    import json

    from test_hf_trainer import run_torchrun

    rc, err = run_torchrun("lightning_ddp_script.py", str(tmp_path), "ddp")
    assert rc == 0, err[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2] and ranks[0]["wrapped"] == "DistributedDataParallel"
    assert ranks[0]["depth_frozen"] and ranks[0]["find_unused"] is True
    assert ranks[0]["a"] == ranks[1]["a"] and ranks[0]["structure"] == ranks[1]["structure"]
    assert (tmp_path / "found" / "structure.json").is_file()
