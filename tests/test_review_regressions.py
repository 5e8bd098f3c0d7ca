"""Regressions found in review: each was a crash or a silently wrong export."""

from __future__ import annotations

import torch
from torch import nn

import dmscale as dms


class _Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 16, 1)
        self.b = nn.Conv2d(16, 4, 1)

    def forward(self, x):
        p, q = self.a(x).split(8, 1)  # sizes written in the code: cannot follow a pruned width
        return self.b(torch.cat([q, p], 1))


def test_split_with_written_sizes_fixes_its_channels():
    space = dms.discover(_Split(), torch.randn(1, 3, 4, 4))
    assert [d.name for d in space.width] == []


class _MaxPermute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(4, 8)
        self.c = nn.Linear(8, 2)

    def forward(self, x):
        y = torch.max(self.a(x), self.b(x))  # elementwise maximum
        y = torch.permute(y, dims=(1, 0, 2)).permute(1, 0, 2)
        return self.c(y)


def test_elementwise_max_and_permute_with_keyword_dims():
    net = _MaxPermute().eval()
    x = torch.randn(2, 3, 4)
    searcher = dms.prepare(net, x, dms.SearchConfig(resource="params", target=0.6))
    assert [d.size for d in searcher.space.width] == [8]  # a and b tied by the maximum
    searcher.randomize_importance(0)  # untrained: random kept channels
    with torch.no_grad():
        for t in searcher.gates.width:
            t.a.fill_(0.5)
        with searcher.hardened():
            hard = net(x)
        torch.testing.assert_close(searcher.export().eval()(x), hard)


def test_rmsnorm_without_eps_is_unchanged_with_open_masks():
    net = nn.Sequential(nn.Linear(4, 8), nn.RMSNorm(8), nn.Linear(8, 2)).eval()
    x = torch.randn(3, 4) * 1e-3  # small activations: eps matters
    with torch.no_grad():
        ref = net(x)
    searcher = dms.prepare(net, x)
    with torch.no_grad(), searcher.hardened():
        torch.testing.assert_close(net(x), ref, atol=1e-6, rtol=1e-5)


def test_budget_solver_without_importance_normalisation():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    x = torch.randn(2, 16)
    searcher = dms.prepare(net, x, dms.SearchConfig(resource="params", target=0.5, normalize=False))
    with torch.no_grad():
        for t in searcher.gates.width:
            t.importance.copy_(torch.rand(t.n_units))
    res = searcher.meet_target()
    assert 0.9 * searcher.target_cost <= res["hard"] <= searcher.target_cost
    assert res["hard"] == dms.count(searcher.export(), x)["params"]


def test_casting_the_model_keeps_structural_state_in_float32():
    net = nn.Sequential(nn.Linear(16, 300), nn.ReLU(), nn.Linear(300, 4))
    x = torch.randn(2, 16)
    searcher = dms.prepare(net, x)
    net.to(torch.bfloat16)
    (topk,) = searcher.gates.width
    assert topk.a.dtype == torch.float32 and topk.importance.dtype == torch.float32
    assert net[0].weight.dtype == torch.bfloat16
    for k in range(1, 301, 7):
        topk.set_count(k)
        assert topk.hard_count() == k
    with torch.no_grad():
        assert net(x.to(torch.bfloat16)).dtype == torch.bfloat16


def _llama_with_a_removed_block(monkeypatch, one_by_one: bool) -> tuple[list[int], float, int]:
    """meet_target on a 3-block Llama whose last block depth search removed (its FFN width is
    then free); returns the width counts, the cost and the number of cost evaluations."""
    dms.ensure_torchvision()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    x = {"input_ids": torch.randint(0, 64, (1, 8))}
    searcher = dms.prepare(LlamaForCausalLM(cfg), x, dms.SearchConfig(
        resource="params", target=0.45, exclude=["model.embed_tokens"]))
    (depth,) = searcher.gates.depth
    with torch.no_grad():
        depth.importance.copy_(torch.tensor([3.0, 2.0, 1.0]))  # the last block is the least important
    depth.set_count(2)
    searcher.gates.depth_frozen = True  # keep the removed block removed
    for i, t in enumerate(searcher.gates.width):
        with torch.no_grad():
            t.importance.copy_(torch.rand(t.n_units))
        t.set_count(1 if i == 5 else t.n_units // 2)  # index 5: the removed block's FFN
    if one_by_one:  # the greedy before free units were given back together
        import dmscale.search.solver

        monkeypatch.setattr(dmscale.search.solver, "_last_free_count", lambda t, k, current, hard_cost: k)
    calls = []
    real = type(searcher.costs).exact
    monkeypatch.setattr(type(searcher.costs), "exact",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    res = searcher.meet_target()
    monkeypatch.undo()
    return [t.hard_count() for t in searcher.gates.width], res["hard"], len(calls)


def test_budget_solver_gives_back_free_units_at_once_with_the_same_result(monkeypatch):
    counts, cost, calls = _llama_with_a_removed_block(monkeypatch, one_by_one=False)
    ref_counts, ref_cost, ref_calls = _llama_with_a_removed_block(monkeypatch, one_by_one=True)
    assert counts == ref_counts and cost == ref_cost
    assert counts[5] == 128  # every FFN channel of the removed block is free
    assert calls < ref_calls / 3, (calls, ref_calls)
