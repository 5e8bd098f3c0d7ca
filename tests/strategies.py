"""Hypothesis strategies for random networks (a helper module for the property tests).

:func:`cnn_nets` draws conv stacks piece by piece -- plain, depthwise and grouped convs,
residual adds (identity or 1x1-projected shortcut, nested), SE gates, channel concat of 2-3
branches, C2f-like ``chunk(2)`` splits, pooling -- then a linear head (a Linear or a small
MLP). :func:`mlp_nets` draws MLPs with residual Linear blocks. :func:`llama_nets` draws tiny
Hugging Face Llama models: 1-2 pre-norm blocks with grouped-query attention (1-2 KV heads,
1-3 query heads per KV head), with or without tied input/output embeddings. The building
blocks are those of :mod:`random_nets`; every choice is a Hypothesis draw, so failures shrink
to a small network.

Every drawn case is a :class:`NetCase`: the model in eval mode with random BatchNorm
statistics, its example input and a one-line description.

Example:
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=2, deadline=None, derandomize=True)
    ... @given(cnn_nets())
    ... def f(case):
    ...     assert case.model(case.inputs).shape[0] == 1
    >>> f()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from random_nets import SE, Concat, ConvBNAct, Head, MLPHead, Net, Residual, SplitHalf, randomize_bn_
from torch import nn

__all__ = ["NetCase", "cnn_nets", "mlp_nets", "llama_nets", "any_nets"]

ACTS = ["relu", "relu_", "silu", "gelu", "hardswish"]
widths = st.integers(2, 16)


@dataclass
class NetCase:
    """A drawn network, its example input and a description for failure messages."""

    model: nn.Module
    inputs: Any
    what: str

    def __repr__(self) -> str:
        return f"NetCase({self.what})\n{self.model}"


def _conv(draw: Any, cin: int, cout: int, k: int | None = None, s: int = 1, act: bool = True,
          dw: bool = False) -> ConvBNAct:
    k = k if k is not None else draw(st.sampled_from([1, 3]))
    a = draw(st.sampled_from(ACTS)) if act else None
    return ConvBNAct(cin, cout, k, s, a, bn=draw(st.booleans()), dw=dw, bias=draw(st.booleans()))


class GroupedConv(nn.Module):
    """Grouped Conv2d (``groups`` in 2..4, neither 1 nor depthwise) -> BN -> ReLU."""

    def __init__(self, cin: int, cout: int, groups: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


def _branch(draw: Any, c: int, depth: int) -> nn.Module:
    """A residual branch (c, h) -> (c, h)."""
    kinds = ["basic", "bottleneck", "mbconv", "single"] + (["nested", "split"] if depth < 1 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "split" and c % 2:
        kind = "single"
    last = draw(st.sampled_from([None] + ACTS))
    if kind == "basic":
        m = draw(widths)
        return nn.Sequential(_conv(draw, c, m, 3), _conv(draw, m, c, act=False))
    if kind == "bottleneck":
        m = draw(widths)
        return nn.Sequential(_conv(draw, c, m, 1), _conv(draw, m, m, 3, dw=draw(st.booleans())),
                             ConvBNAct(m, c, 1, 1, last))
    if kind == "mbconv":
        m = draw(widths)
        parts: list[nn.Module] = [_conv(draw, c, m, 1), _conv(draw, m, m, 3, dw=True)]
        if draw(st.booleans()):
            parts.append(SE(m, draw(st.integers(1, 6)), pool=draw(st.sampled_from(["mean", "adaptive"]))))
        parts.append(ConvBNAct(m, c, 1, 1, last))
        return nn.Sequential(*parts)
    if kind == "single":
        return ConvBNAct(c, c, draw(st.sampled_from([1, 3])), 1, last)
    if kind == "nested":
        return nn.Sequential(*[_residual(draw, c, depth + 1) for _ in range(draw(st.integers(1, 2)))])
    half = c // 2
    return SplitHalf(_residual(draw, half, depth + 1), which=draw(st.sampled_from(["a", "b"])), keep="other")


def _residual(draw: Any, c: int, depth: int = 0) -> Residual:
    return Residual(_branch(draw, c, depth), None, order=draw(st.sampled_from(["xf", "fx", "iadd"])),
                    post=draw(st.sampled_from([None] + ACTS)), post_as=draw(st.sampled_from(["module", "function"])))


def _piece(draw: Any, c: int, h: int) -> tuple[nn.Module, int, int]:
    kind = draw(st.sampled_from(["conv", "dw", "grouped", "res", "stage", "proj", "se", "concat", "split", "pool"]))
    if kind == "conv":
        s = 2 if h >= 8 and draw(st.booleans()) else 1
        c2 = draw(widths)
        return _conv(draw, c, c2, s=s), c2, h // s
    if kind == "dw":
        return _conv(draw, c, c, 3, dw=True), c, h
    if kind == "grouped":
        g = draw(st.integers(2, 4))
        c_in = g * draw(st.integers(1, 4))
        c2 = g * draw(st.integers(1, 4))
        pre = _conv(draw, c, c_in, 1)
        return nn.Sequential(pre, GroupedConv(c_in, c2, g)), c2, h
    if kind == "res":
        return _residual(draw, c), c, h
    if kind == "stage":
        return nn.Sequential(*[_residual(draw, c) for _ in range(draw(st.integers(2, 3)))]), c, h
    if kind == "proj":
        c2 = draw(widths.filter(lambda w: w != c))
        m = draw(widths)
        f = nn.Sequential(_conv(draw, c, m, 3), _conv(draw, m, c2, act=False))
        block = Residual(f, _conv(draw, c, c2, 1, act=False), order=draw(st.sampled_from(["xf", "fx", "iadd"])),
                         post=draw(st.sampled_from([None] + ACTS)))
        return block, c2, h
    if kind == "se":
        return SE(c, draw(st.integers(1, 6)), pool=draw(st.sampled_from(["mean", "adaptive"]))), c, h
    if kind == "concat":
        branches, total = [], 0
        for _ in range(draw(st.integers(2, 3))):
            b = draw(st.sampled_from(["conv", "identity", "res"]))
            if b == "conv":
                cb = draw(widths)
                branches.append(_conv(draw, c, cb))
            else:
                cb = c
                branches.append(nn.Identity() if b == "identity" else _residual(draw, c, 1))
            total += cb
        c2 = draw(widths)
        return nn.Sequential(Concat(branches), _conv(draw, total, c2, 1)), c2, h
    if kind == "split":
        pre = []
        if c % 2:
            pre.append(_conv(draw, c, c + 1, 1))
            c += 1
        half = c // 2
        ch = draw(widths)
        inner = _conv(draw, half, ch, 3)
        keep = draw(st.sampled_from(["both", "other"]))
        out = (2 * half if keep == "both" else half) + ch
        c2 = draw(widths)
        mods = pre + [SplitHalf(inner, which=draw(st.sampled_from(["a", "b"])), keep=keep), _conv(draw, out, c2, 1)]
        return nn.Sequential(*mods), c2, h
    if h >= 4:
        return draw(st.sampled_from([nn.MaxPool2d(2), nn.AvgPool2d(2)])), c, h // 2
    return nn.Identity(), c, h


def _head(draw: Any, c: int, kind: str) -> nn.Module:
    feats = c * 4 if kind == "pool2" else c
    hidden = draw(st.lists(widths, max_size=2))
    return Head(c, kind, MLPHead(feats, hidden, draw(st.sampled_from(ACTS)), draw(st.integers(2, 5)),
                                 bn=draw(st.booleans()), dropout=draw(st.booleans())))


@st.composite
def cnn_nets(draw: Any) -> NetCase:
    """A conv stack (stem + 1-4 pieces) with a linear or MLP head on (1, C, H, W) input."""
    cin, h = draw(st.sampled_from([1, 3])), draw(st.sampled_from([8, 16]))
    hw = h
    c = draw(widths)
    body: list[nn.Module] = [_conv(draw, cin, c, 3)]
    kinds = []
    for _ in range(draw(st.integers(1, 4))):
        piece, c, h = _piece(draw, c, h)
        body.append(piece)
        kinds.append(type(piece).__name__)
    head = _head(draw, c, draw(st.sampled_from(["mean", "pool1", "pool2"])))
    seed = draw(st.integers(0, 2 ** 16))
    torch.manual_seed(seed)
    net = Net(nn.Sequential(*body), head)
    with torch.no_grad():  # weights from the seed alone (modules were built while drawing)
        for p in net.parameters():
            scale = p[0].numel() ** -0.5 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape) * scale)
    randomize_bn_(net, torch.Generator().manual_seed(seed))
    x = torch.randn(1, cin, hw, hw, generator=torch.Generator().manual_seed(seed))
    return NetCase(net.eval(), x, f"cnn seed={seed} pieces={kinds}")


@st.composite
def mlp_nets(draw: Any) -> NetCase:
    """Linear stem, 1-3 residual Linear blocks or plain Linear layers, Linear head."""
    f_in, c = draw(st.integers(2, 12)), draw(widths)
    layers: list[nn.Module] = [nn.Linear(f_in, c), nn.ReLU()]
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            m = draw(widths)
            layers.append(Residual(nn.Sequential(nn.Linear(c, m), nn.GELU(), nn.Linear(m, c)), None,
                                   order=draw(st.sampled_from(["xf", "fx"]))))
        else:
            c2 = draw(widths)
            layers += [nn.Linear(c, c2), nn.SiLU()]
            c = c2
    layers.append(nn.Linear(c, draw(st.integers(1, 5))))
    seed = draw(st.integers(0, 2 ** 16))
    torch.manual_seed(seed)
    net = nn.Sequential(*layers)
    for mod in net.modules():
        if isinstance(mod, nn.Linear):
            mod.reset_parameters()
    x = torch.randn(1, f_in, generator=torch.Generator().manual_seed(seed))
    return NetCase(net.eval(), x, f"mlp seed={seed}")


@st.composite
def llama_nets(draw: Any) -> NetCase:
    """A tiny Hugging Face Llama: pre-norm blocks, GQA attention, optional tied embeddings."""
    from dmscale.core._compat import ensure_torchvision

    ensure_torchvision()
    from transformers import LlamaConfig, LlamaForCausalLM

    kv = draw(st.integers(1, 2))
    groups = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([4, 8]))
    heads = kv * groups
    layers = draw(st.integers(1, 2))
    tied = draw(st.booleans())
    ffn = draw(st.integers(4, 24))
    seed = draw(st.integers(0, 2 ** 16))
    cfg = LlamaConfig(vocab_size=32, hidden_size=heads * head_dim, intermediate_size=ffn,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      head_dim=head_dim, max_position_embeddings=16, tie_word_embeddings=tied,
                      attention_dropout=0.0, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 32, (1, 6), generator=torch.Generator().manual_seed(seed))
    what = f"llama seed={seed} layers={layers} heads={heads} kv={kv} head_dim={head_dim} ffn={ffn} tied={tied}"
    return NetCase(model, {"input_ids": ids}, what)


def any_nets(transformers: bool = True) -> st.SearchStrategy[NetCase]:
    """CNNs, MLPs and (unless ``transformers`` is False) tiny Llamas."""
    options = [cnn_nets(), cnn_nets(), mlp_nets()] + ([llama_nets()] if transformers else [])
    return st.one_of(*options)
