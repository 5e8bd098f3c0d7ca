"""Norms are recognised by what they compute (issue 8, defect 1), never by class name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmscale as dms
from dmscale.trace.handlers.norms import norm_formula


class OffsetRMSNorm(nn.Module):
    """``norm(x) * (1 + weight)``, as Hugging Face Gemma computes it (name ends in RMSNorm)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n) * 0.5)
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


class AbsMeanRMSNorm(nn.Module):
    """Not an RMS norm: divides by the mean absolute value. Must never be guessed as one."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.eps = 1e-6

    def forward(self, x):
        return x / (x.abs().mean(-1, keepdim=True) + self.eps) * self.weight


class Stream(nn.Module):
    """A pre-norm residual MLP whose hidden dim runs through ``norm``."""

    def __init__(self, norm: type[nn.Module], d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList([nn.ModuleDict({"norm": norm(d), "fc1": nn.Linear(d, 32),
                                                    "fc2": nn.Linear(32, d)}) for _ in range(2)])
        self.final = norm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b["fc2"](torch.relu(b["fc1"](b["norm"](h))))
        return self.head(self.final(h))


def _random_structure(searcher, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(searcher.gates.width) + list(searcher.gates.depth):
            t.importance.copy_(torch.rand(t.importance.shape, generator=g))
            t.a.fill_(float(torch.rand((), generator=g)) * t.max_ratio)


def _check_exact(model: nn.Module, x, out=lambda y: y, target: float = 0.6) -> "dms.Searcher":
    with torch.no_grad():
        ref = out(model(**x) if isinstance(x, dict) else model(x))
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="params", target=target))
    run = (lambda m: out(m(**x))) if isinstance(x, dict) else (lambda m: out(m(x)))
    with torch.no_grad(), searcher.gates.use("open"):
        assert torch.allclose(run(model), ref, atol=1e-5)
    _random_structure(searcher)
    with torch.no_grad(), searcher.hardened():
        hard = run(model)
    small = searcher.export()
    with torch.no_grad():
        assert torch.allclose(run(small), hard, atol=1e-5)
    assert searcher.resources()["hard"] == dms.count(small, x)["params"]
    return searcher


def test_probe_tells_the_formulas_apart():
    assert norm_formula(OffsetRMSNorm(8)).kind == "rms"
    assert norm_formula(nn.RMSNorm(8)).kind == "rms"
    assert norm_formula(nn.RMSNorm(8, eps=None)).eps is None
    assert norm_formula(nn.LayerNorm(8)).kind == "layernorm"
    assert norm_formula(AbsMeanRMSNorm(8)) is None
    assert norm_formula(nn.Linear(8, 8)) is None
    assert norm_formula(nn.LayerNorm((4, 8))) is None  # over two dims


class WrongEpsRMSNorm(nn.RMSNorm):
    """Declares ``eps`` = 1e-9 but normalises with 1e-2."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2) * self.weight


def test_probe_checks_the_declared_eps():
    assert norm_formula(nn.RMSNorm(8, eps=1e-2)).eps == pytest.approx(1e-2)
    assert norm_formula(WrongEpsRMSNorm(8, eps=1e-9)) is None


def test_offset_rmsnorm_is_exact_not_rewritten_as_weight_times_norm():
    # before: the hook chose the formula from the class name and computed norm(x) * weight
    torch.manual_seed(0)
    searcher = _check_exact(Stream(OffsetRMSNorm).eval(), torch.randn(4, 8))
    assert any(d.size == 16 for d in searcher.space.width)  # the hidden dim is searched


def test_unknown_norm_is_never_guessed():
    torch.manual_seed(0)
    model = Stream(AbsMeanRMSNorm).eval()
    try:
        searcher = _check_exact(model, torch.randn(4, 8))
    except dms.UnsupportedLayerError as err:  # refused, naming the layer
        assert "norm" in str(err)
        return
    assert all(d.size != 16 for d in searcher.space.width)  # or its channels stay fixed


def test_timm_channels_first_layernorm_is_not_taken_for_a_last_dim_norm():
    dms.ensure_torchvision()
    timm = pytest.importorskip("timm")
    assert norm_formula(timm.layers.LayerNorm2d(8)) is None
    assert norm_formula(timm.layers.LayerNorm(8)).kind == "layernorm"


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_hugging_face_gemma_family_is_exact(family):
    dms.ensure_torchvision()
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls = {
        "gemma": ("GemmaConfig", "GemmaForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    }[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="eager")
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.5)  # zero-initialised: (1 + w) and w would differ by 1 anyway
    x = {"input_ids": torch.randint(0, 64, (2, 10))}
    _check_exact(model, x, out=lambda y: y.logits)
