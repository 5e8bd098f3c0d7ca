"""Mask hooks: keyword inputs (defect 3) and the MHA fast-path switch (defect 11)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmscale as dms


class KeywordCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.fc(input=h)  # the input as a keyword


def test_layer_called_with_its_input_as_a_keyword_is_masked():
    torch.manual_seed(0)
    model = KeywordCall()
    x = torch.randn(8, 6)
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="macs", target=0.5))
    loss = model(x).pow(2).mean()
    loss.backward()
    grad = searcher.gates.width[0].ratio_grad
    assert grad is not None and grad.abs() > 0  # the mask acts, so the task loss sees it
    assert searcher.gates.width[0].importance.abs().sum() > 0
    with torch.no_grad():
        searcher.gates.width[0].set_count(5)
    model.eval()
    with torch.no_grad(), searcher.hardened():
        hard = model(x)
    small = searcher.export()
    with torch.no_grad():
        torch.testing.assert_close(small(x), hard)


class Failing(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


class MHANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fail = False

    def forward(self, x):
        h = self.inp(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.fc2(torch.relu(self.fc1(h)))
        if self.fail:
            raise RuntimeError("boom")
        return h


def test_mha_fastpath_switch_is_restored_when_a_forward_raises():
    model = MHANet().eval()
    x = torch.randn(2, 5, 8)
    assert torch.backends.mha.get_fastpath_enabled()
    dms.prepare(model, x, dms.SearchConfig(resource="macs", target=0.8))
    model.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        model(x)
    assert torch.backends.mha.get_fastpath_enabled()


def test_a_block_run_without_grad_first_leaves_the_other_blocks_depth_gradient():
    """Each depth mask is unbound once per forward, under the forward's grad mode: a first
    block run under ``no_grad`` (frozen) once made every block share gradient-free views, and
    the depth ratio's gradient was 0."""
    from torch import nn

    import dmscale as dms

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.f(torch.relu(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
            self.blocks = nn.ModuleList([Block() for _ in range(3)])
            self.freeze_first = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for i, b in enumerate(self.blocks):
                with torch.set_grad_enabled(torch.is_grad_enabled() and not (self.freeze_first and i == 0)):
                    h = b(h)
            return self.out(h)

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    for fold in (True, False):
        model = Net()
        s = dms.prepare(model, x[:1], dms.SearchConfig(resource="macs", target=0.5, fold_masks=fold))
        with torch.no_grad():
            for p in s.structure_parameters():
                p.fill_(0.3)
        model.freeze_first = True
        model(x).pow(2).sum().backward()
        depth_a = s.gates.depth[0].a
        assert depth_a.grad is not None and float(depth_a.grad.abs()) > 0, f"fold_masks={fold}"


@pytest.mark.parametrize("frozen", [False, True])
def test_batched_hard_masks_equal_every_gate_s_own(frozen):
    """Hard masks of every gate from one batched evaluation on the device (no ``.item()`` per
    gate) equal the gates' own ``hard_mask()``, ties in importance and required groups included."""
    from zoo import ZOO

    entry = ZOO["resnet20"]
    searcher = dms.prepare(entry.build(), torch.randn(2, *entry.input_shape[1:]), dms.SearchConfig(target=0.5))
    searcher.randomize_importance(3)
    g = torch.Generator().manual_seed(0)
    gates = list(searcher.gates.width) + list(searcher.gates.depth)
    with torch.no_grad():
        for t in gates:
            t.a.uniform_(0.0, 0.9, generator=g)
        gates[0].importance[:4] = gates[0].importance[4]  # ties: the lower index ranks higher
    gates[1].required_groups = [torch.tensor([0, 1])]  # its own path
    searcher.gates.depth_frozen = frozen
    batched = searcher.costs.masks("hard")
    own = searcher.costs.masks("hard", cache={})  # gate by gate (the budget solver's path)
    assert torch.equal(batched[0], own[0]) and torch.equal(batched[1], own[1])
    assert searcher.costs.exact("hard") == searcher.costs.exact("hard", cache={})


def test_the_bank_is_reused_until_a_gate_is_replaced_or_changes_what_the_bank_batches():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6), torch.nn.ReLU(),
                              torch.nn.Linear(6, 2))
    g = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig(target=0.5)).gates
    bank, which = g._bank_for()
    assert g._bank_for() == (bank, which)  # cached: the same gates
    g.width[0].importance = g.width[0].importance.clone()  # a replaced buffer (load_state_dict(assign=True))
    rebuilt, _ = g._bank_for()
    assert rebuilt is not bank and g.width[0].importance._base is rebuilt.matrix
    g.width[0].decay = 0.5  # settings no longer shared: every gate on its own path
    assert g._bank_for() == (None, [])


def _resnet20_search(seed: int = 0, **config):
    from zoo import ZOO

    entry = ZOO["resnet20"]
    torch.manual_seed(seed)
    model = entry.build()
    searcher = dms.prepare(model, torch.randn(2, *entry.input_shape[1:]), dms.SearchConfig(target=0.5, **config))
    return model, searcher, torch.randn(4, *entry.input_shape[1:])


def test_forward_and_resource_loss_share_one_ratio_stack_and_give_the_gradients_of_separate_ones():
    """The resource loss reuses the training forward's stacked ratios (one gradient per gate per
    backward); the gradients equal those of two separate stacks, also with the two losses
    backpropagated one after the other, and an optimiser step between forward and resource
    loss is seen (the ratios' version counters)."""
    grads = []
    for shared in (True, False):
        model, s, x = _resnet20_search()
        s.randomize_importance(0)
        bank, _ = s.gates._bank_for()
        task = model(x).square().mean()
        forward_stack = bank._stacked[2]
        if not shared:
            bank.__dict__.pop("_stacked")  # the resource loss stacks its own
        resource = s.resource_loss(0.5)
        assert (bank._stacked[2] is forward_stack) == shared
        task.backward()
        resource.backward()  # a second backward through the shared stack (it saves no tensor)
        grads.append(torch.stack([g.ratio_grad for g in (*s.gates.width, *s.gates.depth)]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-6, atol=1e-12) and grads[0].abs().sum() > 0

    model, s, x = _resnet20_search()
    model(x)
    before = float(s.resource_loss(0.5))
    with torch.no_grad():
        for g in s.gates.width:
            g.a.add_(0.2)  # what an optimiser step does (in place)
    after = float(s.resource_loss(0.5))
    bank, _ = s.gates._bank_for()
    bank.__dict__.pop("_stacked")
    assert after != before and after == float(s.resource_loss(0.5))


def test_unit_positions_follow_every_importance_update():
    """The ranks are reused while the importance is unchanged and computed again after an
    update through the bank (the gradient hook) or through a gate's own buffer."""
    from dmscale.core.gate_bank import GateBank

    model, s, x = _resnet20_search()
    s.randomize_importance(1)
    bank, which = s.gates._bank_for()
    first = bank.unit_positions()
    assert bank.unit_positions() is first
    model(x).square().mean().backward()  # Eq. 4 through the bank's hook
    gates = [(*s.gates.width, *s.gates.depth)[i] for i in which]
    gates[0].importance.copy_(torch.rand(gates[0].importance.shape))  # a gate's own view
    fresh = GateBank(gates)  # (built from the same buffers: the ranks from scratch)
    assert torch.equal(bank.unit_positions(), fresh.unit_positions())
    assert not torch.equal(bank.unit_positions(), first)


def test_a_depth_frozen_between_the_forward_and_the_resource_loss_gets_no_gradient_from_it():
    """The resource loss of the first width-only step freezes depth after the forward
    (``requires_grad_(False)``, no version change) and stacks the ratios anew: reusing the
    forward's stack sent the frozen ratios a gradient (and DDP, which had found them unused,
    failed on it)."""
    model, s, x = _resnet20_search(width_only_from=0.4)
    assert len(s.gates.depth) > 0 and not s.gates.depth_frozen
    model(x).square().mean()
    loss = s.resource_loss(0.5)  # progress 0.5: depth frozen from here on
    assert s.gates.depth_frozen
    reached = _leaves_reached(loss)  # (autograd drops a gradient to a frozen leaf; DDP's hook saw it)
    assert not any(v is g.a for g in s.gates.depth for v in reached)
    assert any(v is s.gates.width_ratios for v in reached)  # every width dim's entry


def _leaves_reached(t: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors the autograd graph of ``t`` sends a gradient to."""
    seen, stack, leaves = set(), [t.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        stack.extend(n for n, _ in node.next_functions)
    return leaves


@pytest.mark.parametrize("name", ["timm_deit_tiny", "hf_llama_gqa"])
def test_a_first_forward_under_inference_mode_leaves_the_search_trainable(name):
    """Regression: the gate bank, its gather indices and the derived slots' indices are built on
    first use and kept; built inside ``torch.inference_mode()`` they were inference tensors, and
    the first forward raised (the bank's version counter), or the next training forward did
    (an inference tensor saved for the backward)."""
    from transformer_zoo import TZOO, output_tensor, task_loss
    entry = TZOO[name]
    model, x = entry.build(), entry.make_inputs()
    searcher = dms.prepare(model, x, dms.SearchConfig(target=0.5))

    def run() -> torch.Tensor:
        return output_tensor(model(**x) if isinstance(x, dict) else model(x))
    with torch.inference_mode():
        evaluated = run()
    model.train()
    loss = task_loss(run()) + searcher.resource_loss(0.5)
    loss.backward()
    grads = [g.ratio_grad for g in searcher.gates.width]
    assert evaluated.isfinite().all() and all(g is not None and g.isfinite().all() for g in grads)
