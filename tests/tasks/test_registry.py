"""The task registry's distillation helpers (src/dmscale/tasks/registry.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dmscale.tasks.registry import Task


class _WithHidden(nn.Module):
    """A model whose forward can return its hidden states, like the causal-LM wrapper."""

    returns_hidden_states = True

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, output_hidden_states: bool = False):
        h = self.body(x)
        logits = self.head(h)
        return (logits, (x, h)) if output_hidden_states else logits


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_forward_hidden_through_a_ddp_wrapped_model(tmp_path) -> None:
    """Under torchrun the step loop hands the DDP wrapper to the distillation; the wrapper has
    no ``returns_hidden_states``, and --distill-hidden used to be refused there."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _WithHidden()
        x = torch.randn(2, 4)
        logits, hidden = Task().forward_hidden(nn.parallel.DistributedDataParallel(model), x)
        ref_logits, ref_hidden = model(x, output_hidden_states=True)
        assert torch.equal(logits, ref_logits) and len(hidden) == 2
        assert all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))
    finally:
        dist.destroy_process_group()


def test_every_task_of_the_cli_is_registered_and_the_registry_knows_no_task():
    """``--task`` choices (config.options.TASKS) are exactly the tasks that registered
    themselves when dmscale.tasks was imported; the registry imports none of them."""
    import ast
    from pathlib import Path

    import dmscale.tasks  # noqa: F401  (registers the built-ins)
    from dmscale.config.options import TASKS
    from dmscale.tasks import registry

    assert sorted(registry._TASKS) == sorted(TASKS)
    assert sorted(registry._MODELS) == sorted(registry.MODEL_FAMILIES)
    tree = ast.parse(Path(registry.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m and m.startswith("dmscale.tasks.") and m != "dmscale.tasks.distill"}


def test_registering_a_task_twice_is_refused_and_unknown_tasks_name_the_choices():
    from dmscale.config.run_config import ConfigError, RunConfig
    from dmscale.tasks.image import build_image_task
    from dmscale.tasks.registry import build_task, register_task

    with pytest.raises(ValueError, match="registered twice"):
        register_task("digits")(lambda cfg: None)
    register_task("digits")(build_image_task)  # the same builder again is fine
    cfg = RunConfig(task="digits").resolved()
    cfg.task = "nope"  # past RunConfig's own validation, as a task removed from the registry would be
    with pytest.raises(ConfigError, match=r"unknown task 'nope'.*digits.*mnist"):
        build_task(cfg)
