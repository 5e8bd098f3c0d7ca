"""Fuzz test of export equivalence over random architectures (see ``random_nets``).

For every seeded random CNN / MLP:

1. hard masks with every ``a = 0`` reproduce the original output (atol 1e-5);
2. for 2 random structures (random importance, ``a = U(0, 1) * max_ratio`` per width and
   depth gate): ``export()(x)`` equals the hardened supernet in eval mode (atol/rtol 1e-4),
   on the example input and on a batch of 3, and the exported layers have the shapes
   ``structure()`` reports;
3. ``dms.count(export, x)`` equals the exact cost at hard masks, for MACs and params;
4. ``apply_structure`` on a copy of the un-prepared net gives the export's state_dict shapes;
5. ``detach`` leaves no hook, the original state_dict keys and the original output.

Every generated net has a hidden layer whose width is searchable, so ``prepare`` must never
answer "found nothing to search". A failure message starts with the net's seed and repr;
``python -c "from random_nets import random_cnn; print(random_cnn(SEED)[0])"`` (in tests/)
rebuilds it.

Two bugs this fuzz found are pinned by minimal reproducers below: a layer whose every
output channel was pruned (one producer of a shared width: ``x + cat(a(x), b(x))``), fixed
by keeping at least one unit of every producer's part of a width; and a removed block's
replacement that aliased its input (an in-place post activation, or ``out = block(x);
out += s``), fixed by ``SkipBlock`` returning a fresh tensor.
"""

from __future__ import annotations

import copy

import pytest
import torch
from random_nets import Residual, random_cnn, random_mlp
from torch import nn

import dmscale as dms

CNN_SEEDS = list(range(60))
MLP_SEEDS = list(range(30))


def _topks(searcher) -> list:
    return list(searcher.gates.width) + list(searcher.gates.depth)


def _randomize_structure(searcher, seed: int) -> None:
    """Random importance (so kept channels are not a prefix) and random ratios."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in _topks(searcher):
            t.importance.copy_(torch.rand(t.importance.shape, generator=g))
            t.a.fill_(float(torch.rand((), generator=g)) * t.max_ratio)


def _hooks(model: torch.nn.Module) -> list[str]:
    names = []
    for name, m in model.named_modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                     "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs"):
            if getattr(m, attr, None):
                names.append(f"{name or '<root>'}.{attr}")
    return names


def _check_shapes(small: nn.Module, fresh: nn.Module, structure: dict, where: str) -> nn.Module:
    """Exported shapes follow the structure, removed blocks hold no weights, and (4)
    apply_structure on the un-prepared net gives the export's state_dict shapes."""
    modules = dict(small.named_modules())
    removed = {b["name"] for b in structure["removed_blocks"]}
    for name, spec in structure["layers"].items():
        if any(name.startswith(r + ".") for r in removed):
            assert name not in modules, f"{where}\n{name} of a removed block is still there"
            continue
        w = modules[name].weight
        if spec["out"] is not None:
            assert w.shape[0] == len(spec["out"]), f"{where}\n{name}: {tuple(w.shape)} vs out {spec['out']}"
        dense = spec["handler"] == "linear" or spec["handler"] == "conv" and modules[name].groups == 1
        if spec["in"] is not None and dense:
            assert w.shape[1] == len(spec["in"]), f"{where}\n{name}: {tuple(w.shape)} vs in {spec['in']}"
    for r in removed:
        assert not any(True for _ in modules[r].parameters()), f"{where}\nremoved block {r} has weights"
    again = dms.apply_structure(copy.deepcopy(fresh), structure)
    shapes = {n: tuple(v.shape) for n, v in small.state_dict().items()}
    assert {n: tuple(v.shape) for n, v in again.state_dict().items()} == shapes, where
    return again


def check_export_properties(net: nn.Module, x: torch.Tensor, what: str) -> None:
    ctx = f"{what}\n{net}"
    net.eval()
    g = torch.Generator().manual_seed(123)
    x3 = torch.randn((3,) + tuple(x.shape[1:]), generator=g)
    with torch.no_grad():
        reference, reference3 = net(x), net(x3)
    keys = list(net.state_dict().keys())
    fresh = copy.deepcopy(net)
    assert not _hooks(net), ctx

    try:
        searcher = dms.prepare(net, x, dms.SearchConfig(resource="macs", target=1.0))
    except ValueError as e:
        if "found nothing to search" in str(e):  # every generated net has a searchable hidden width
            pytest.fail(f"{ctx}\nprepare found nothing to search in a net with hidden layers: {e}")
        raise
    assert searcher.gates.width or searcher.gates.depth, ctx

    # (1) every mask open: the original function
    with torch.no_grad():
        for t in _topks(searcher):
            t.a.zero_()
    with torch.no_grad(), searcher.hardened():
        out = net(x)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0, msg=lambda m: f"{ctx}\nopen masks: {m}")

    for k in range(2):
        _randomize_structure(searcher, 1000 + k)
        with torch.no_grad(), searcher.hardened():
            hard, hard3 = net(x), net(x3)
        small = searcher.export().eval()
        structure = searcher.structure()
        where = f"{ctx}\nstructure {k}: width {[(w['name'], w['size'], w['kept']) for w in structure['width']]}, " \
                f"depth {[(d['name'], d['kept']) for d in structure['depth']]}, " \
                f"removed {[b['name'] for b in structure['removed_blocks']]}"
        removed = [b["name"] for b in structure["removed_blocks"]]
        empty = [n for n, spec in structure["layers"].items()
                 if spec["out"] == [] and not any(n.startswith(r + ".") for r in removed)]
        assert not empty, f"{where}\nlayers pruned to 0 output channels: {empty}"
        xc, x3c = x.clone(), x3.clone()
        # (2) the export computes what the hardened supernet computes
        with torch.no_grad():
            out, out3 = small(xc), small(x3c)
        assert torch.equal(xc, x) and torch.equal(x3c, x3), f"{where}\nthe export modified its input in place"
        torch.testing.assert_close(out, hard, atol=1e-4, rtol=1e-4, msg=lambda m: f"{where}\nexport vs hard: {m}")
        torch.testing.assert_close(out3, hard3, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"{where}\nexport vs hard (B=3): {m}")
        # (3) exact cost at hard masks == count of the export
        exact = dms.count(small, x.clone())
        macs = round(searcher.costs.exact("hard", "macs"))
        params = round(searcher.costs.exact("hard", "params"))
        assert (macs, params) == (exact["macs"], exact["params"]), \
            f"{where}\ncost model (macs, params) = {(macs, params)}, count(export) = {exact}"
        # shapes; (4) apply_structure on the un-prepared net: same shapes, same function
        again = _check_shapes(small, fresh, structure, where)
        with torch.no_grad():
            torch.testing.assert_close(again.eval()(x.clone()), out, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{where}\napply_structure vs export: {m}")
        assert not _hooks(small), f"{where}\nexport has hooks {_hooks(small)}"

    # the supernet's exact cost is the plain model's count
    plain = dms.count(fresh, x)
    assert round(searcher.costs.exact(None, "macs")) == plain["macs"], ctx
    assert round(searcher.costs.exact(None, "params")) == plain["params"], ctx

    # (5) detach: no hooks, original keys, original function
    dms.detach(net)
    assert not _hooks(net), f"{ctx}\nhooks left: {_hooks(net)}"
    assert not hasattr(net, "dms_gates"), ctx
    assert list(net.state_dict().keys()) == keys, ctx
    with torch.no_grad():
        torch.testing.assert_close(net(x), reference, atol=0, rtol=0, msg=lambda m: f"{ctx}\nafter detach: {m}")
        torch.testing.assert_close(net(x3), reference3, atol=0, rtol=0, msg=lambda m: f"{ctx}\nafter detach: {m}")


@pytest.mark.parametrize("seed", CNN_SEEDS)
def test_random_cnn_export(seed):
    net, x = random_cnn(seed)
    check_export_properties(net, x, f"random_cnn({seed})")


@pytest.mark.parametrize("seed", MLP_SEEDS)
def test_random_mlp_export(seed):
    net, x = random_mlp(seed)
    check_export_properties(net, x, f"random_mlp({seed})")


class _CatResidual(nn.Module):
    """``x + cat(a(x), b(x))``: the residual stream's 4 channels come from two producers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 1, 1)
        self.b = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.cat([self.a(x), self.b(x)], 1)


# Regression (random_cnn 6, 37, 50 and random_mlp 3): one layer of a shared width lost all
# its channels and the export held a Conv2d(4, 0). Every producer now keeps >= 1 unit.
def test_export_producer_pruned_to_zero_channels():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 1), _CatResidual(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(4, 2)).eval()
    x = torch.randn(1, 3, 8, 8)
    searcher = dms.prepare(net, x, dms.SearchConfig(resource="macs", target=1.0))
    (topk,) = searcher.gates.width  # one dimension: '0', '1.a' and '1.b' all write it
    with torch.no_grad():
        topk.importance.copy_(torch.tensor([0.0, 1.0, 1.0, 1.0]))  # 1.a's only channel ranks last
        topk.a.fill_(0.25)  # keep 3 of 4
    # 1.a's only channel ranks last, yet it stays: the weakest other channel goes instead
    assert searcher.structure()["layers"]["1.a"]["out"] is None
    assert searcher.structure()["layers"]["1.b"]["out"] is not None
    assert int(topk.hard_mask().sum()) == 3
    with torch.no_grad(), searcher.hardened():
        hard = net(x)
    small = searcher.export().eval()
    with torch.no_grad():
        out = small(x)
    torch.testing.assert_close(out, hard, atol=1e-5, rtol=1e-5)
    exact = dms.count(small, x)
    assert round(searcher.costs.exact("hard", "macs")) == exact["macs"]
    assert round(searcher.costs.exact("hard", "params")) == exact["params"]


class _InplaceBlock(nn.Module):
    """``relu_(x + conv(x))`` with an in-place post-add ReLU module (torchvision BasicBlock style)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(x + self.conv(x))


class _ReadAgain(nn.Module):
    """``cat(block(x), conv(x))``: the block's input is read again after the block ran."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.block = _InplaceBlock(c)
        self.conv = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.block(x), self.conv(x)], 1)


# Regression (a), minimal reproducer of what the fuzz found (random_cnn 149, 290 and,
# through a mutated model input, random_cnn 66, 91, 309, random_mlp 172, 203 in a sweep of
# seeds 60-460): the copied post activation ran in place on the block's input.
def test_removed_block_with_inplace_post_activation():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 1), _ReadAgain(4), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 2)).eval()
    x = torch.randn(1, 3, 8, 8)
    # one block, removed by hand: no training, so say that position decides (importance="index")
    searcher = dms.prepare(net, x, dms.SearchConfig(resource="macs", target=1.0, importance="index"))
    assert [b.name for d in searcher.space.depth for b in d.blocks] == ["1.block"]
    with torch.no_grad():
        for t in searcher.gates.depth:
            t.a.fill_(t.max_ratio)  # remove the block
    assert searcher.structure()["removed_blocks"][0]["post_module"] == "1.block.relu"
    with torch.no_grad(), searcher.hardened():
        hard = net(x)
    small = searcher.export().eval()
    x_in = x.clone()
    with torch.no_grad():
        out = small(x_in)
    # small.1.block is SkipBlock(ReLU(inplace=True)): relu_ overwrites the stem's output,
    # which small.1.conv then reads
    torch.testing.assert_close(out, hard, atol=1e-5, rtol=1e-5)
    assert torch.equal(x_in, x)


class _Block(nn.Module):
    """``x + conv(x)`` (no post activation)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x)


class _InplaceCaller(nn.Module):
    """``out = block(x); out += proj(x)``, then ``cat(out, x)``: the caller adds in place to the
    block's output and reads the block's input again."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.block = _Block(c)
        self.proj = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        out += self.proj(x)
        return torch.cat([out, x], 1)


# Regression (b), minimal reproducer of what the fuzz found (random_cnn 391: a nested
# block, the branch f of a Residual doing ``out = f(x); out += x``): the replacement returned
# its input itself.
def test_removed_block_output_mutated_by_caller():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 1), _InplaceCaller(4), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 2)).eval()
    x = torch.randn(1, 3, 8, 8)
    # one block, removed by hand: no training, so say that position decides (importance="index")
    searcher = dms.prepare(net, x, dms.SearchConfig(resource="macs", target=1.0, importance="index"))
    assert [b.name for d in searcher.space.depth for b in d.blocks] == ["1.block"]
    with torch.no_grad():
        for t in searcher.gates.depth:
            t.a.fill_(t.max_ratio)  # remove the block
    with torch.no_grad(), searcher.hardened():
        hard = net(x)
    small = searcher.export().eval()
    with torch.no_grad():
        out = small(x)
    # small.1.block is SkipBlock(): it returns the stem's output itself, `out += proj(x)`
    # then overwrites it, and the concat reads the overwritten tensor
    torch.testing.assert_close(out, hard, atol=1e-5, rtol=1e-5)
