"""Hardware-aligned widths (``SearchConfig(align=N)``): every searched width a multiple of N.

On real model definitions (a torchvision ResNet-18 and a timm ViT whose per-head dims are
searched, both at 32x32 input): the found structure, the exported modules and the cost; the
auto default, the validation, dims whose size is not a multiple of N, and resuming states
saved before the option existed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import dmscale as dms
from dmscale.core.errors import ConfigError
from dmscale.search.config import resolve_align

dms.ensure_torchvision()


def _resnet18() -> tuple[nn.Module, torch.Tensor]:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=4).eval(), torch.randn(1, 3, 32, 32)


def _vit() -> tuple[nn.Module, torch.Tensor]:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, num_classes=4,
                              depth=4)
    return model.eval(), torch.randn(1, 3, 32, 32)


def _searched(build, **config) -> tuple[nn.Module, torch.Tensor, dms.Searcher, nn.Module]:
    model, x = build()
    searcher = dms.prepare(model, x, dms.SearchConfig(target=0.5, **config))
    searcher.randomize_importance(0)
    searcher.meet_target()
    return model, x, searcher, searcher.export()


def _layer_widths(model: nn.Module) -> list[tuple[str, int]]:
    """(name, width) of every channel count of the convolutions, linears and norms."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            out += [(f"{name} in", m.in_channels), (f"{name} out", m.out_channels)]
        elif isinstance(m, nn.Linear):
            out += [(f"{name} in", m.in_features), (f"{name} out", m.out_features)]
        elif isinstance(m, nn.BatchNorm2d):
            out.append((name, m.num_features))
        elif isinstance(m, nn.LayerNorm):
            out.append((name, m.normalized_shape[-1]))
    return out


# ----------------------------------------------------------------------------- real models
@pytest.mark.parametrize("build", [_resnet18, _vit], ids=["resnet18", "vit"])
def test_aligned_search_keeps_every_searched_width_a_multiple_of_8(build):
    supernet, x = build()
    full = dms.count(supernet, x)["macs"]
    model, x, searcher, small = _searched(build, align=8)
    assert searcher.align == 8 and searcher.unaligned == []
    structure = searcher.structure()
    assert structure["align"] == {"multiple": 8, "unaligned": []}
    heads = [w for w in structure["width"] if w["name"].endswith(".heads")]
    channels = [w for w in structure["width"] if not w["name"].endswith(".heads")]
    assert all(w["kept"] % 8 == 0 for w in channels), [(w["name"], w["kept"]) for w in channels]
    assert any(w["kept"] < w["size"] for w in channels)  # the search did prune
    # head counts are counts: searched one head at a time
    gates = dict(zip([d.name for d in searcher.space.width], searcher.gates.width))
    assert all(gates[w["name"]].step == 1 for w in heads)
    # the exported model: every channel count a multiple of 8 but the fixed input (3 colours)
    # and output (4 classes)
    odd = [(n, c) for n, c in _layer_widths(small) if c % 8 and c not in (3, 4)]
    assert odd == []
    # the cost: within the budget, and what the exported model costs
    res = searcher.resources()
    exact = dms.count(small, x)["macs"]
    assert exact == round(res["hard"]) <= searcher.target_cost
    assert exact >= 0.9 * searcher.target_cost and exact < 0.55 * full
    # structure files stay loadable
    rebuilt = dms.apply_structure(build()[0], structure)
    assert dms.count(rebuilt, x)["macs"] == exact


def test_vit_head_dims_are_searched_and_exported_in_multiples_of_8():
    _, x, searcher, small = _searched(_vit, align=8)
    head_dims = [w for w in searcher.structure()["width"] if w["name"].endswith(".head_dim")]
    assert head_dims and all(w["size"] == 64 and w["kept"] % 8 == 0 for w in head_dims)
    assert any(w["kept"] < 64 for w in head_dims)
    kept = [b for b in small.blocks if hasattr(b, "attn")]  # a removed block is an Identity
    assert kept
    for block in kept:
        attn = block.attn
        assert attn.head_dim % 8 == 0
        assert attn.qkv.out_features == 3 * attn.num_heads * attn.head_dim
    assert small(x).shape == (1, 4)


def test_align_1_and_auto_on_cpu_search_as_before():
    _, _, auto, small_auto = _searched(_resnet18)
    _, _, one, small_one = _searched(_resnet18, align=1)
    assert auto.align == one.align == 1  # auto resolves to 1 on a CPU model
    assert auto.unaligned == one.unaligned == []
    assert all(t.step == 1 for t in auto.gates.width)
    s_auto, s_one = auto.structure(), one.structure()
    assert s_auto["layers"] == s_one["layers"] and s_auto["width"] == s_one["width"]
    assert s_auto["align"] == {"multiple": 1, "unaligned": []}
    assert any(w["kept"] % 8 for w in s_one["width"])  # free widths: some are not multiples of 8


def test_resolve_align_fits_the_device():
    assert resolve_align(None, "cpu") == 1
    assert resolve_align(None, torch.device("cpu")) == 1
    assert resolve_align(None, "cuda") == 8
    assert resolve_align(None, torch.device("cuda", 1)) == 8
    assert resolve_align(None, None) == 1
    assert resolve_align(4, "cuda") == 4 and resolve_align(1, "cuda") == 1  # an explicit value wins
    assert resolve_align(16, "cpu") == 16


# ----------------------------------------------------------------------------- the rules
@pytest.mark.parametrize("value", [0, -8, 2.5, True, "eight"])
def test_bad_align_values_name_what_was_expected_and_got(value):
    with pytest.raises(ConfigError, match=rf"align: expected auto \(8 on a CUDA device, 1 "
                                          rf"elsewhere\) or an integer >= 1 .* got {value!r}"):
        dms.SearchConfig(align=value)
    assert dms.SearchConfig(align="8").align == 8  # the command line's and a config file's spelling


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 20), nn.ReLU(), nn.Linear(20, 96), nn.ReLU(),
                         nn.Linear(96, 2)), torch.randn(2, 4)


def test_width_step_combines_with_align_as_their_lcm_and_min_width_rounds_up():
    net, x = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        searcher = dms.prepare(net, x, dms.SearchConfig(align=8, width_step=12, min_width=30, target=0.9))
    wide = searcher.gates.width[1]
    assert (wide.size, wide.step, wide.n_units, wide.min_units) == (96, 24, 4, 2)
    with torch.no_grad():
        wide.set_count(0)  # clamped to the minimum: two units of 24
    assert int(wide.hard_mask().sum()) == 48


def test_a_dim_overrides_step_that_is_not_a_multiple_of_align_is_refused():
    net, x = _mlp()
    with pytest.raises(ConfigError, match=r"dim_overrides\['2'\] step 12 is not a multiple of align 8"
                                          r".*step of 24"):
        dms.prepare(net, x, dms.SearchConfig(align=8, dim_overrides={"2": {"step": 12}}))
    assert not hasattr(net, "dms_gates")  # prepare left the model as it was
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ok = dms.prepare(net, x, dms.SearchConfig(align=8, dim_overrides={"2": {"step": 16}}))
    assert ok.gates.width[1].step == 16


def test_a_dim_whose_size_is_not_a_multiple_is_searched_unaligned_and_listed():
    net, x = _mlp()
    with pytest.warns(UserWarning, match=r"align=8: 1 width dim\(s\) .* not a multiple of 8 .*: 0 "):
        searcher = dms.prepare(net, x, dms.SearchConfig(resource="params", target=0.5, align=8))
    assert searcher.unaligned == ["0"]  # 20 channels: no multiple of 8 keeps all of them
    narrow, wide = searcher.gates.width
    assert (narrow.step, wide.step) == (1, 8)
    searcher.randomize_importance(0)
    res = searcher.meet_target()
    structure = searcher.structure()
    assert structure["align"] == {"multiple": 8, "unaligned": ["0"]}
    assert structure["width"][1]["kept"] % 8 == 0
    small = searcher.export()
    assert dms.count(small, x)["params"] == round(res["hard"]) <= searcher.target_cost


def test_a_target_below_the_aligned_minimum_says_align_bounds_it():
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(ConfigError, match=r"\[96 \(smallest\), 192 \(supernet\)\].* multiple of 8"
                                          r".*align=8; align=1, --align 1, searches every width"):
        dms.prepare(net, torch.randn(2, 4), dms.SearchConfig(target=0.2, align=8))
    dms.prepare(net, torch.randn(2, 4), dms.SearchConfig(target=0.2, align=1))  # reachable


# ----------------------------------------------------------------------------- resume
def test_states_record_the_resolved_align_and_older_states_resume_unaligned():
    net, x = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        aligned = dms.prepare(net, x, dms.SearchConfig(align=8)).state_dict()
        auto = dms.prepare(_mlp()[0], x, dms.SearchConfig()).state_dict()
        assert aligned["config"]["align"] == 8 and auto["config"]["align"] == 1  # resolved
        older = dict(auto, config={k: v for k, v in auto["config"].items() if k != "align"})
        dms.prepare(_mlp()[0], x, dms.SearchConfig()).load_state_dict(older)  # before align: 1
        dms.prepare(_mlp()[0], x, dms.SearchConfig(align=1)).load_state_dict(auto)
        with pytest.raises(ValueError, match=r"align: saved 8, now 1"):
            dms.prepare(_mlp()[0], x, dms.SearchConfig()).load_state_dict(aligned)
        with pytest.raises(ValueError, match=r"align: saved 1, now 8"):
            dms.prepare(_mlp()[0], x, dms.SearchConfig(align=8)).load_state_dict(older)
