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
