"""Seeded generator of small random CNNs and MLPs (a helper module for the fuzz tests).

:func:`random_cnn` combines, at random: conv (k in {1, 3}, stride 1 or 2) + BN + activation,
depthwise convs, residual blocks ``x + f(x)`` / ``act(x + f(x))`` (identity shortcut, or a
1x1 projection when the shape changes), SE gates, channel concat of 2-3 branches, equal
``chunk(2, dim=1)`` splits with one half processed (C2f-like), max/avg pooling, and a head
(global pool or a flattened 2x2 map, then a Linear or a 1-2 hidden-layer MLP).
:func:`random_mlp` builds MLPs on (B, F) inputs with residual Linear blocks, splits and
concats. Every net has at least one hidden layer whose width is searchable.

Every build is deterministic in its seed (``random.Random(seed)`` for the architecture,
``torch.manual_seed(seed)`` for the weights) and BatchNorm statistics are random, so BN is
not the identity in eval mode. ``repr(net)`` describes the architecture, including the
forward variant of every custom piece.

Example:
    >>> net, x = random_cnn(0)
    >>> net.eval()(x).shape[0]
    1
"""

from __future__ import annotations

import random
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["random_cnn", "random_mlp", "randomize_bn_", "ConvBNAct", "Residual", "SE",
           "Concat", "SplitHalf", "Head", "MLPHead"]

# activation name -> module factory
_ACT_MODULES: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "relu_": lambda: nn.ReLU(inplace=True),
    "silu": nn.SiLU,
    "gelu": nn.GELU,
    "hardswish": nn.Hardswish,
}
# activation name -> function (for post-add activations written as functions)
_ACT_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "relu_": lambda t: F.relu(t, inplace=True),
    "silu": F.silu,
    "gelu": F.gelu,
    "hardswish": F.hardswish,
}


def randomize_bn_(model: nn.Module, g: torch.Generator) -> nn.Module:
    """Random running_mean/var and affine parameters for every BatchNorm, in place."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.2)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
                if m.weight is not None:
                    m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                    m.bias.copy_(torch.randn(n, generator=g) * 0.2)
    return model


# ---------------------------------------------------------------------------- pieces


class ConvBNAct(nn.Module):
    """Conv2d ('same' padding) -> [BatchNorm2d] -> [activation]; depthwise if ``dw``."""

    def __init__(self, cin: int, cout: int, k: int = 3, s: int = 1, act: str | None = "relu",
                 bn: bool = True, dw: bool = False, bias: bool = False) -> None:
        super().__init__()
        groups = cin if dw else 1
        if dw:
            cout = cin
        self.conv = nn.Conv2d(cin, cout, k, s, padding=k // 2, groups=groups, bias=bias or not bn)
        self.bn = nn.BatchNorm2d(cout) if bn else None
        self.act = _ACT_MODULES[act]() if act else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.bn is not None:
            x = self.bn(x)
        if self.act is not None:
            x = self.act(x)
        return x


class Residual(nn.Module):
    """``post(shortcut(x) + f(x))``; shortcut is the identity or a projection module.

    order: "xf" (x + f), "fx" (f + x) or "iadd" (``out = f(x); out += x``).
    post: None, or an activation name; ``post_as`` "module" or "function".
    """

    def __init__(self, f: nn.Module, proj: nn.Module | None = None, order: str = "xf",
                 post: str | None = None, post_as: str = "module") -> None:
        super().__init__()
        self.f = f
        self.proj = proj
        self.order = order
        self.post_name = post
        self.post_as = post_as
        self.post = _ACT_MODULES[post]() if post and post_as == "module" else None

    def extra_repr(self) -> str:
        return f"order={self.order}, post={self.post_name}, post_as={self.post_as}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x if self.proj is None else self.proj(x)
        y = self.f(x)
        if self.order == "xf":
            out = s + y
        elif self.order == "fx":
            out = y + s
        else:
            out = y
            out += s
        if self.post is not None:
            out = self.post(out)
        elif self.post_name:
            out = _ACT_FUNCTIONS[self.post_name](out)
        return out


class SE(nn.Module):
    """``x * sigmoid(fc2(relu(fc1(mean(x)))))`` with 1x1 convs (squeeze width ``r``)."""

    def __init__(self, c: int, r: int, pool: str = "mean") -> None:
        super().__init__()
        self.pool = pool
        self.fc1 = nn.Conv2d(c, r, 1)
        self.fc2 = nn.Conv2d(r, c, 1)

    def extra_repr(self) -> str:
        return f"pool={self.pool}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool == "mean":
            s = x.mean((2, 3), keepdim=True)
        else:
            s = F.adaptive_avg_pool2d(x, 1)
        s = self.fc2(torch.relu(self.fc1(s)))
        return x * torch.sigmoid(s)


class Concat(nn.Module):
    """``cat([b(x) for b in branches], dim)``."""

    def __init__(self, branches: list[nn.Module], dim: int = 1) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self.branches], self.dim)


class SplitHalf(nn.Module):
    """``a, b = x.chunk(2, dim)``; process one half with ``f``; concat.

    which: "b" processes the second half, "a" the first. keep: "both" -> cat(a, b, f(.)),
    "other" -> cat(other half, f(.)) (C2f-like).
    """

    def __init__(self, f: nn.Module, which: str = "b", keep: str = "other", dim: int = 1) -> None:
        super().__init__()
        self.f = f
        self.which = which
        self.keep = keep
        self.dim = dim

    def extra_repr(self) -> str:
        return f"which={self.which}, keep={self.keep}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, self.dim)
        if self.which == "b":
            y = self.f(b)
            parts = [a, b, y] if self.keep == "both" else [a, y]
        else:
            y = self.f(a)
            parts = [a, b, y] if self.keep == "both" else [b, y]
        return torch.cat(parts, self.dim)


class MLPHead(nn.Module):
    """Linear (-> act [-> BN1d] [-> dropout] -> Linear)* on (B, F)."""

    def __init__(self, c: int, hidden: list[int], act: str, n_out: int, bn: bool, dropout: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for h in hidden:
            layers.append(nn.Linear(c, h))
            layers.append(_ACT_MODULES[act]())
            if bn:
                layers.append(nn.BatchNorm1d(h))
            if dropout:
                layers.append(nn.Dropout(0.1))
            c = h
        layers.append(nn.Linear(c, n_out))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Head(nn.Module):
    """Pool to (B, C) -- global pool, ``mean((2, 3))`` or a flattened 2x2 map -- then an MLP."""

    def __init__(self, c: int, kind: str, mlp: MLPHead) -> None:
        super().__init__()
        self.kind = kind
        self.pool = nn.AdaptiveAvgPool2d(2 if kind == "pool2" else 1) if kind != "mean" else None
        self.mlp = mlp

    def extra_repr(self) -> str:
        return f"kind={self.kind}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "mean":
            x = x.mean((2, 3))
        elif self.kind == "pool2":
            x = torch.flatten(self.pool(x), 1)
        else:
            x = self.pool(x).flatten(1)
        return self.mlp(x)


class Net(nn.Module):
    """body (nn.Sequential) -> head."""

    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


# ---------------------------------------------------------------------------- CNN generator


class _Gen:
    def __init__(self, rng: random.Random) -> None:
        self.r = rng

    def width(self) -> int:
        return self.r.randint(4, 24)

    def even_width(self) -> int:
        return 2 * self.r.randint(2, 12)

    def act(self) -> str:
        return self.r.choice(list(_ACT_MODULES))

    def conv(self, cin: int, cout: int, k: int | None = None, s: int = 1, act: str | None | bool = True,
             dw: bool = False) -> ConvBNAct:
        k = k if k is not None else self.r.choice([1, 3])
        a = self.act() if act is True else (act or None)
        bn = self.r.random() < 0.85
        return ConvBNAct(cin, cout, k, s, a, bn=bn, dw=dw, bias=self.r.random() < 0.2)

    # -------------------------------------------------------------- residual branches c -> c
    def branch_same(self, c: int, depth: int) -> nn.Module:
        """f: (c, h) -> (c, h), ending in a module (so the block is removable)."""
        r = self.r
        kinds = ["basic", "bottleneck", "mbconv", "single"]
        if depth < 2:
            kinds += ["nested", "concat", "se_only"]
            if c % 2 == 0:
                kinds.append("split")
        kind = r.choice(kinds)
        last_act = self.act() if r.random() < 0.3 else None
        if kind == "basic":
            m = self.width()
            return nn.Sequential(self.conv(c, m, 3), self.conv(m, c, r.choice([1, 3]), act=last_act))
        if kind == "bottleneck":
            m = self.width()
            return nn.Sequential(self.conv(c, m, 1), self.conv(m, m, 3, dw=r.random() < 0.4),
                                 self.conv(m, c, 1, act=last_act))
        if kind == "mbconv":
            m = self.width()
            parts = [self.conv(c, m, 1), self.conv(m, m, 3, dw=True)]
            if r.random() < 0.6:
                parts.append(SE(m, r.randint(2, 8), pool=r.choice(["mean", "adaptive"])))
            parts.append(self.conv(m, c, 1, act=last_act))
            return nn.Sequential(*parts)
        if kind == "single":
            return self.conv(c, c, r.choice([1, 3]), act=last_act)
        if kind == "se_only":
            return nn.Sequential(self.conv(c, c, 3, dw=r.random() < 0.5), SE(c, r.randint(2, 8)))
        if kind == "nested":
            return nn.Sequential(*[self.residual_identity(c, depth + 1) for _ in range(r.randint(1, 2))])
        if kind == "concat":
            n = r.choice([2, 3]) if c >= 3 else 2
            if c < n:
                return self.conv(c, c, 3)
            cuts = sorted(r.sample(range(1, c), n - 1))
            sizes = [b - a for a, b in zip([0] + cuts, cuts + [c])]
            return Concat([self.conv(c, s, r.choice([1, 3])) for s in sizes])
        # split: cat(other half, f(half)) keeps c channels
        half = c // 2
        inner = self.conv(half, half, 3) if r.random() < 0.5 else self.residual_identity(half, depth + 1)
        return SplitHalf(inner, which=r.choice(["a", "b"]), keep="other")

    def residual_identity(self, c: int, depth: int = 0) -> Residual:
        r = self.r
        post = self.act() if r.random() < 0.5 else None
        return Residual(self.branch_same(c, depth), None, order=r.choice(["xf", "fx", "iadd"]),
                        post=post, post_as=r.choice(["module", "function"]))

    def residual_proj(self, c: int, h: int) -> tuple[Residual, int, int]:
        r = self.r
        c2 = self.width()
        s = 2 if h >= 8 and r.random() < 0.5 else 1
        if c2 == c and s == 1:
            c2 = c + 2
        m = self.width()
        f = nn.Sequential(self.conv(c, m, 3, s=s), self.conv(m, c2, r.choice([1, 3]), act=None))
        proj = self.conv(c, c2, 1, s=s, act=None)
        post = self.act() if r.random() < 0.6 else None
        block = Residual(f, proj, order=r.choice(["xf", "fx", "iadd"]), post=post,
                         post_as=r.choice(["module", "function"]))
        return block, c2, h // s

    # -------------------------------------------------------------- body pieces
    def piece(self, c: int, h: int) -> tuple[nn.Module, int, int]:
        r = self.r
        kinds = ["conv", "conv", "dw", "res", "res", "stage", "proj", "se", "concat", "split", "pool"]
        kind = r.choice(kinds)
        if kind == "conv":
            s = 2 if h >= 8 and r.random() < 0.4 else 1
            c2 = self.width()
            return self.conv(c, c2, s=s), c2, h // s
        if kind == "dw":
            s = 2 if h >= 8 and r.random() < 0.3 else 1
            return self.conv(c, c, 3, s=s, dw=True), c, h // s
        if kind == "res":
            return self.residual_identity(c), c, h
        if kind == "stage":  # a run of 2-3 sibling identity blocks (one depth dimension)
            return nn.Sequential(*[self.residual_identity(c) for _ in range(r.randint(2, 3))]), c, h
        if kind == "proj":
            return self.residual_proj(c, h)
        if kind == "se":
            return SE(c, r.randint(2, 8), pool=r.choice(["mean", "adaptive"])), c, h
        if kind == "concat":
            branches, total = [], 0
            for _ in range(r.choice([2, 3])):
                b = r.choice(["conv", "conv", "dwconv", "identity", "res"])
                if b == "conv":
                    cb = self.width()
                    branches.append(self.conv(c, cb))
                elif b == "dwconv":
                    cb = self.width()
                    branches.append(nn.Sequential(self.conv(c, c, 3, dw=True), self.conv(c, cb, 1)))
                elif b == "identity":
                    cb = c
                    branches.append(nn.Identity())
                else:
                    cb = c
                    branches.append(self.residual_identity(c, 1))
                total += cb
            mod: nn.Module = Concat(branches)
            if total > 40 or r.random() < 0.5:  # fuse back down
                c2 = self.width()
                mod = nn.Sequential(mod, self.conv(total, c2, 1))
                total = c2
            return mod, total, h
        if kind == "split":
            pre: list[nn.Module] = []
            if c % 2:
                c_even = self.even_width()
                pre.append(self.conv(c, c_even, 1))
                c = c_even
            half = c // 2
            keep = r.choice(["both", "other"])
            which = r.choice(["a", "b"])
            inner_kind = r.choice(["conv", "res", "stage"])
            if inner_kind == "conv":
                ch = self.width()
                inner: nn.Module = self.conv(half, ch, 3)
            elif inner_kind == "res":
                ch, inner = half, self.residual_identity(half, 1)
            else:
                ch = half
                inner = nn.Sequential(*[self.residual_identity(half, 1) for _ in range(r.randint(2, 3))])
            out = (2 * half if keep == "both" else half) + ch
            mods = pre + [SplitHalf(inner, which=which, keep=keep)]
            if r.random() < 0.7:  # C2f: fuse with a 1x1 conv
                c2 = self.width()
                mods.append(self.conv(out, c2, 1))
                out = c2
            return (mods[0] if len(mods) == 1 else nn.Sequential(*mods)), out, h
        # pool
        if h >= 4 and r.random() < 0.7:
            return r.choice([nn.MaxPool2d(2), nn.AvgPool2d(2)]), c, h // 2
        return nn.MaxPool2d(3, 1, 1), c, h

    def head(self, c: int) -> tuple[nn.Module, int]:
        r = self.r
        kind = r.choice(["gap", "gap", "mean", "pool2"])
        feat = 4 * c if kind == "pool2" else c
        hidden = [self.width() for _ in range(r.choice([0, 0, 1, 2]))]
        mlp = MLPHead(feat, hidden, self.act(), n_out=r.randint(2, 10), bn=r.random() < 0.3,
                      dropout=r.random() < 0.3)
        return Head(c, kind, mlp), mlp.layers[-1].out_features


def random_cnn(seed: int) -> tuple[nn.Module, torch.Tensor]:
    """A random small CNN for (1, 3, 16, 16) inputs, and its example input."""
    r = random.Random(seed)
    torch.manual_seed(seed)
    gen = _Gen(r)
    c, h = 3, 16
    body: list[nn.Module] = []
    if r.random() < 0.1:  # a residual block right on the (fixed) input channels
        body.append(gen.residual_identity(c, 1))
    c2 = gen.width()
    body.append(gen.conv(c, c2, 3, s=r.choice([1, 2])))  # stem: always a searchable width
    c, h = c2, 16 // body[-1].conv.stride[0]
    for _ in range(r.randint(2, 5)):
        mod, c, h = gen.piece(c, h)
        body.append(mod)
    head, _ = gen.head(c)
    if r.random() < 0.3:  # flat: the residual blocks are direct children of the root
        net: nn.Module = nn.Sequential(*body, head)
    else:
        net = Net(nn.Sequential(*body), head)
    randomize_bn_(net, torch.Generator().manual_seed(seed))
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(seed + 10_000))
    return net.eval(), x


# ---------------------------------------------------------------------------- MLP generator


class _LinAct(nn.Module):
    def __init__(self, cin: int, cout: int, act: str | None, bn: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(cin, cout)
        self.bn = nn.BatchNorm1d(cout) if bn else None
        self.act = _ACT_MODULES[act]() if act else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        if self.bn is not None:
            x = self.bn(x)
        if self.act is not None:
            x = self.act(x)
        return x


def random_mlp(seed: int) -> tuple[nn.Module, torch.Tensor]:
    """A random MLP for (1, F) inputs (residual Linear blocks, splits, concats), and its input."""
    r = random.Random(seed)
    torch.manual_seed(seed)
    act = lambda: r.choice(list(_ACT_MODULES))  # noqa: E731
    width = lambda: r.randint(4, 24)  # noqa: E731
    lin = lambda a, b, last_act=True: _LinAct(a, b, act() if last_act else None, r.random() < 0.3)  # noqa: E731

    def res_block(c: int) -> Residual:
        m = width()
        f = nn.Sequential(lin(c, m), lin(m, c, last_act=r.random() < 0.3))
        post = act() if r.random() < 0.5 else None
        return Residual(f, None, order=r.choice(["xf", "fx", "iadd"]), post=post,
                        post_as=r.choice(["module", "function"]))

    f_in = r.randint(4, 16)
    c = f_in
    body: list[nn.Module] = []
    if r.random() < 0.2:
        body.append(res_block(c))  # on the (fixed) input features
    c2 = width()
    body.append(lin(c, c2))
    c = c2
    for _ in range(r.randint(1, 4)):
        kind = r.choice(["lin", "res", "stage", "proj", "split", "concat", "dropout"])
        if kind == "lin":
            c2 = width()
            body.append(lin(c, c2))
            c = c2
        elif kind == "res":
            body.append(res_block(c))
        elif kind == "stage":
            body.append(nn.Sequential(*[res_block(c) for _ in range(r.randint(2, 3))]))
        elif kind == "proj":
            c2 = width()  # c2 == c is fine: a projection is never an identity shortcut
            m = width()
            f = nn.Sequential(lin(c, m), lin(m, c2, last_act=False))
            body.append(Residual(f, nn.Linear(c, c2), order=r.choice(["xf", "fx", "iadd"]),
                                 post=act() if r.random() < 0.5 else None,
                                 post_as=r.choice(["module", "function"])))
            c = c2
        elif kind == "split":
            if c % 2:
                c2 = 2 * r.randint(2, 12)
                body.append(lin(c, c2))
                c = c2
            half = c // 2
            inner: nn.Module = res_block(half) if r.random() < 0.5 else lin(half, width())
            ch = half if isinstance(inner, Residual) else inner.fc.out_features
            keep = r.choice(["both", "other"])
            body.append(SplitHalf(inner, which=r.choice(["a", "b"]), keep=keep))
            c = (2 * half if keep == "both" else half) + ch
        elif kind == "concat":
            branches, total = [], 0
            for _ in range(r.choice([2, 3])):
                if r.random() < 0.25:
                    branches.append(nn.Identity())
                    total += c
                else:
                    cb = width()
                    branches.append(lin(c, cb))
                    total += cb
            body.append(Concat(branches))
            c = total
        else:
            body.append(nn.Dropout(0.2))
    body.append(nn.Linear(c, r.randint(2, 10)))
    net = nn.Sequential(*body) if r.random() < 0.5 else Net(nn.Sequential(*body[:-1]), body[-1])
    randomize_bn_(net, torch.Generator().manual_seed(seed))
    x = torch.randn(1, f_in, generator=torch.Generator().manual_seed(seed + 10_000))
    return net.eval(), x
