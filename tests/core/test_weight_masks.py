"""Masks folded into weights compute the same search as masks on activations, on the whole zoo.

For every model of :data:`zoo.ZOO` and :data:`transformer_zoo.TZOO`, two copies are prepared
with ``fold_masks=True`` (the default: ``conv(X, W * m)``) and ``fold_masks=False`` (the
paper's ``conv(X * m, W)``) and trained side by side from the same state: outputs, the
gradients of the structural parameters, the importances (Eq. 4) and the found structure
must agree.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import pytest
import torch
from torch import nn

import dmscale as dms
from dmscale.core.mask_hooks import MaskBranch
from dmscale.core.weight_masks import FoldDepth, FoldMask, fold_plan
from transformer_zoo import TZOO, output_tensor, task_loss
from zoo import ZOO

MODELS = sorted(ZOO) + sorted(TZOO)


def _entry(name: str) -> tuple[nn.Module, object]:
    if name in TZOO:
        entry = TZOO[name]
        return entry.build(), entry.make_inputs()
    entry = ZOO[name]
    g = torch.Generator().manual_seed(1)
    return entry.build(), torch.randn((4,) + tuple(entry.input_shape[1:]), generator=g)


def _call(model: nn.Module, x: object) -> torch.Tensor:
    return output_tensor(model(**x) if isinstance(x, dict) else model(x))


def _example(x: object) -> object:
    return {k: v[:1] for k, v in x.items()} if isinstance(x, dict) else x[:1]


def _pair(name: str) -> tuple[list[tuple[nn.Module, dms.Searcher]], object]:
    model, x = _entry(name)
    # eval: no dropout (two forwards draw different random masks) and BatchNorm on its (random)
    # running statistics (batch statistics of 4 images amplify rounding by 1 / std); the
    # gates train (importance is tracked)
    model.eval()
    out = []
    for fold in (True, False):
        m = copy.deepcopy(model)
        s = dms.prepare(m, _example(x), dms.SearchConfig(resource="macs", target=0.5, fold_masks=fold))
        s.gates.train()
        s.randomize_importance(0)
        with torch.no_grad():  # ratios inside the soft band of many units
            for i, t in enumerate([*s.gates.width, *s.gates.depth]):
                t.a.fill_(0.15 + 0.05 * (i % 5))
        out.append((m, s))
    return out, x


def _folds(model: nn.Module) -> int:
    return sum(isinstance(h, FoldMask) for m in model.modules() for h in m._forward_pre_hooks.values())


@pytest.mark.parametrize("name", MODELS)
def test_weight_folded_masks_give_the_same_search(name: str) -> None:
    (folded, s_fold), (plain, s_act) = (pair := _pair(name))[0]
    x = pair[1]
    assert _folds(plain) == 0
    assert _folds(folded) > 0, f"{name}: no convolution or linear layer had its mask folded"
    opt_w = torch.optim.SGD(s_act.model_parameters(), lr=1e-3)
    opt_s = torch.optim.SGD(s_act.structure_parameters(), lr=0.02)
    steps = 3
    for step in range(steps):
        # every step starts from the activation-masked copy's weights and ratios (the float
        # differences of the two would otherwise grow through the non-smooth ReLUs and
        # max-pools); the importances are not copied: each copy accumulates its own (Eq. 4)
        with torch.no_grad():
            for p_f, p_a in zip(folded.parameters(), plain.parameters()):
                p_f.copy_(p_a)
        outs = []
        for m, s in ((folded, s_fold), (plain, s_act)):
            for p in m.parameters():
                p.grad = None
            y = _call(m, x)
            (task_loss(y) + s.resource_loss(step / steps)).backward()
            outs.append((y.detach(), [None if p.grad is None else p.grad.clone() for p in s.structure_parameters()]))
        opt_w.step(), opt_s.step()
        (y_f, g_f), (y_a, g_a) = outs
        torch.testing.assert_close(y_f, y_a, rtol=1e-4, atol=1e-5, msg=f"{name}: outputs, step {step}")
        assert [g is None for g in g_f] == [g is None for g in g_a]
        gf, ga = (torch.cat([g.reshape(-1) for g in gs if g is not None]) for gs in (g_f, g_a))
        # norm-wise: a ReLU or max-pool tie decided the other way moves a few terms of one sum
        scale = float(ga.abs().max())
        assert float((gf - ga).abs().max()) <= 2e-3 * scale + 1e-6, \
            f"{name}: gradients of the ratios differ at step {step}: {gf} vs {ga}"
    with torch.no_grad():
        for p_f, p_a in zip(folded.parameters(), plain.parameters()):
            p_f.copy_(p_a)
    for t_f, t_a in zip(list(s_fold.gates.width) + list(s_fold.gates.depth),
                        list(s_act.gates.width) + list(s_act.gates.depth)):
        torch.testing.assert_close(t_f.importance, t_a.importance, rtol=1e-3, atol=1e-12)
    s_fold.meet_target(), s_act.meet_target()
    found_f, found_a = s_fold.structure(), s_act.structure()
    for found in (found_f, found_a):
        found["resource"].pop("soft")  # the soft cost differs in the last digits
    assert found_f == found_a
    with s_fold.hardened(), torch.no_grad():  # the folded hard masks are the export's function
        folded.eval()
        y_hard = _call(folded, x)
    small = s_fold.export()
    torch.testing.assert_close(_call(small.eval(), x), y_hard, rtol=1e-4, atol=1e-5)


def test_fold_plan_refuses_layers_that_would_compute_something_else() -> None:
    class Standardised(nn.Conv2d):  # a weight-standardised conv: W * m would be renormalised
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = (self.weight - self.weight.mean((1, 2, 3), keepdim=True))
            return nn.functional.conv2d(x, w, self.bias, self.stride, self.padding)

    assert fold_plan(nn.Conv2d(4, 4, 3), 1, "in") is not None
    assert fold_plan(Standardised(4, 4, 3), 1, "in") is None
    assert fold_plan(nn.ConvTranspose2d(4, 4, 3), 1, "in") is None
    assert fold_plan(nn.Linear(4, 4), 1, "in") is None or fold_plan(nn.Linear(4, 4), -1, "in") is not None
    lin = nn.Linear(4, 4)
    torch.nn.utils.parametrize.register_parametrization(lin, "weight", nn.Identity())
    assert fold_plan(lin, -1, "in") is None  # a parametrised weight is not a plain parameter


def test_folded_weight_is_shadowed_only_during_the_call_and_parameters_are_untouched() -> None:
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    s = dms.prepare(net, torch.randn(2, 6), dms.SearchConfig(resource="params", target=0.5))
    seen = {}
    net[2].register_forward_pre_hook(lambda m, a: seen.setdefault("w", m.weight))
    net(torch.randn(16, 6))  # (16, 8) into a (3, 8) weight: the weight is the smaller, masked
    assert not isinstance(seen["w"], nn.Parameter)  # the masked weight during the call
    assert isinstance(net[2].weight, nn.Parameter) and "weight" not in net[2].__dict__
    assert set(net.state_dict()) - {k for k in net.state_dict() if k.startswith("dms_gates.")} == set(before)
    with pytest.raises(RuntimeError):
        with s.gates.use("soft"):
            net(torch.randn(2, 5))  # a shape error inside the forward: the shadow is removed
    assert "weight" not in net[2].__dict__
    dms.detach(net)
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())


def test_while_dynamo_traces_the_folds_leave_the_module_dict_alone(monkeypatch) -> None:
    """Regression: torch 2.11's dynamo cannot remove the shadow from a module's ``__dict__``
    (a graph break in every folded layer, a recompilation per layer, 4.5x a plain step on
    an H200 under ``torch.compile(model)``). While tracing, ``Unfold`` computes each folded
    layer again from its input with the folded weight and bias: the same function."""
    import timm

    torch.manual_seed(0)
    net = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, depth=2, num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)
    s = dms.prepare(net, x[:1], dms.SearchConfig(resource="macs", target=0.5))
    s.randomize_importance(0)
    kinds = {type(h).__name__ for m in net.modules() for h in m._forward_pre_hooks.values()}
    assert {"FoldMask", "FoldDepth"} <= kinds  # qkv's output fold, fc2 / proj's depth folds
    with s.gates.use("soft"):
        eager = net(x)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        writes = []
        for m in net.modules():
            m.register_forward_hook(lambda mod, a, o: writes.extend(k for k in ("weight", "bias") if k in mod.__dict__),
                                    prepend=True)  # before Unfold
        traced = net(x)
    assert not writes  # nothing shadowed
    torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-5)
    # hooks pickled before the Unfold knew its folds: they shadow the weight as in eager mode
    for m in net.modules():
        for h in list(m._forward_pre_hooks.values()) + list(m._forward_hooks.values()):
            for attr in ("via_unfold", "folds", "unfold"):
                h.__dict__.pop(attr, None)
    with s.gates.use("soft"):
        old = net(x)
    assert writes and all(k not in m.__dict__ for m in net.modules() for k in ("weight", "bias"))
    torch.testing.assert_close(old, eager, rtol=1e-5, atol=1e-5)


def _traced_graph(net: nn.Module, x: torch.Tensor) -> torch.fx.Graph:
    graphs = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(net, backend=capture)(x)
    torch._dynamo.reset()
    return graphs[-1].graph  # (the gates' masks are computed eagerly, before the layers' graph)


def test_under_torch_compile_a_folded_layer_is_computed_with_its_folded_weight() -> None:
    """While dynamo traces, the consumer's input fold multiplies its weight, not its input, as
    in eager mode at this batch (the input has more elements than the weight): the layer is
    computed again in ``Unfold`` from the unmasked input, and its own output, unused, is left
    for the compiler to drop. Before, every fold multiplied the activation under compile (a
    reduction over the batch for each mask's gradient, which inductor splits in two kernels)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 8)  # the consumer's input (8 x 16) outnumbers its weight (4 x 16)
    dms.prepare(net, x[:1], dms.SearchConfig(resource="params", target=0.5))
    graph = _traced_graph(net, x)
    linears = [n for n in graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear]
    folded = [n for n in linears if getattr(n.args[1], "target", None) in (operator.mul, torch.mul)]
    assert len(folded) == 1, [n.args for n in linears]
    weight, mask = folded[0].args[1].args
    assert weight.op == "placeholder" and "modules_2_parameters_weight" in weight.name
    assert folded[0].args[0].target is nn.functional.relu  # the input as the ReLU left it, unmasked


def test_a_hook_the_user_put_on_a_folded_layer_sees_its_masked_output_eager_and_traced(monkeypatch) -> None:
    """A forward hook registered before ``prepare`` on a folded layer sees what the layer
    returns to the model, eager and while dynamo traces: ``Unfold`` runs first among the
    layer's forward hooks. Before, it ran after them: while tracing such a hook saw the layer's
    output computed without the fold (the folded output replaces it in ``Unfold``)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 8)
    seen = []
    net[2].register_forward_hook(lambda mod, a, out: seen.append(out.detach().clone()))
    s = dms.prepare(net, x[:1], dms.SearchConfig(resource="params", target=0.5))
    s.randomize_importance(0)
    with s.gates.use("soft"):
        eager = net(x)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        traced = net(x)
    torch.testing.assert_close(traced, eager)
    assert len(seen) >= 2
    torch.testing.assert_close(seen[-2], eager)
    torch.testing.assert_close(seen[-1], traced)


@pytest.mark.slow
def test_inductor_drops_the_output_a_folded_layer_computed_before_its_fold() -> None:
    """The compiled step runs as many matrix products as the plain one: the layer's own
    output, which ``Unfold`` replaces, is dead code in the graph."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    def products(prepare: bool) -> Counter:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        x = torch.randn(32, 8)
        if prepare:
            dms.prepare(net, x[:1], dms.SearchConfig(resource="params", target=0.5))
        torch._dynamo.reset()
        run = torch.compile(net)
        for _ in range(2):
            run(x).square().sum().backward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(x).square().sum().backward()
        torch._dynamo.reset()
        return Counter(e.name for e in prof.events() if e.name in ("aten::mm", "aten::addmm"))

    plain, searched = products(False), products(True)
    assert sum(plain.values()) == 8 and sum(searched.values()) == sum(plain.values()), (plain, searched)


def test_a_layer_whose_input_is_smaller_than_its_weight_masks_the_input() -> None:
    """A language model's head (vocabulary x hidden) at a few tokens: masking the weight would
    copy the whole matrix; the input is masked instead, the same function and mask gradient."""
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 500))
    x = torch.randn(4, 6)
    outs, grads = [], []
    for fold in (True, False):
        net = copy.deepcopy(head)
        s = dms.prepare(net, x[:1], dms.SearchConfig(resource="params", target=0.5, fold_masks=fold))
        s.randomize_importance(0)
        seen = {}
        net[2].register_forward_pre_hook(lambda m, a: seen.setdefault("w", m.weight))
        y = net(x)
        assert isinstance(seen["w"], nn.Parameter)  # (4, 8) input < (500, 8) weight: not folded
        y.logsumexp(-1).mean().backward()
        outs.append(y.detach())
        grads.append([p.grad.clone() for p in s.structure_parameters() if p.grad is not None])
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def _depth_hooks(model: nn.Module) -> tuple[list[str], list[str]]:
    """(layers whose weights take a depth mask, modules whose outputs are multiplied by one)."""
    mods = list(model.named_modules())
    folded = [n for n, m in mods if any(isinstance(h, FoldDepth) for h in m._forward_pre_hooks.values())]
    on_output = [n for n, m in mods if any(isinstance(h, MaskBranch) for h in m._forward_hooks.values())]
    return folded, on_output


@pytest.mark.parametrize("name, last", [
    ("timm_deit_tiny", ("attn.proj", "mlp.fc2")),  # through proj_drop and the Identity drop paths
    ("hf_llama_gqa", ("self_attn.o_proj", "mlp.down_proj")),  # the attention returns o_proj's output
])
def test_transformer_branches_take_their_depth_mask_in_their_last_projection(name: str, last: tuple) -> None:
    model, x = _entry(name)
    dms.prepare(model, _example(x), dms.SearchConfig(resource="macs", target=0.5))
    folded, on_output = _depth_hooks(model)
    assert on_output == [], f"{name}: depth masks left on activations: {on_output}"
    assert len(folded) == 2 * len(TZOO[name].layers) and all(n.endswith(last) for n in folded), folded


def test_a_branch_ending_in_a_layer_that_cannot_fold_keeps_the_mask_on_its_output() -> None:
    """GPT-2's attention returns ``resid_dropout(c_proj(h))`` but c_proj is a Hugging Face
    Conv1D (weight stored (in, out), not torch's own forward): the mask stays on the output."""
    model, x = _entry("hf_gpt2")
    dms.prepare(model, _example(x), dms.SearchConfig(resource="macs", target=0.5))
    folded, on_output = _depth_hooks(model)
    assert folded == [] and len(on_output) == 2 * len(TZOO["hf_gpt2"].layers), (folded, on_output)


def test_every_multiply_by_a_depth_mask_or_an_output_mask_reads_its_own_entry() -> None:
    """A ViT block's depth mask goes into proj's and fc2's weight and bias (4 multiplies) and
    qkv's output mask into its weight and bias: each reads its own scalar or slice of one
    gather, so their gradients are summed in the gathers' backward, not by an addition per
    extra read (4 per block on ViT-B before); the search is the same."""
    model, x = _entry("timm_deit_tiny")
    s = dms.prepare(model, _example(x), dms.SearchConfig(resource="macs", target=0.5))
    blocks = len(TZOO["timm_deit_tiny"].layers)
    gates = s.gates
    assert gates.read_index.tolist() == [b for b in range(blocks) for _ in range(4)]
    assert sum(k.startswith("outb_") for k in gates.forward_masks.layout.keys) == blocks  # qkv's bias
    model(x)
    units = [gates.depth_unit(0, b) for b in range(blocks)]
    values = [gates.depth_value(r) for r in range(4 * blocks)]
    assert len({id(v) for v in values}) == 4 * blocks  # distinct entries, not one unit read 4 times
    for r, v in enumerate(values):
        assert torch.equal(v, units[r // 4])


def _held_for_backward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The model's output and the bytes of the storages its graph holds for the backward pass,
    the model's own parameters and buffers left out (held anyway)."""
    skip = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in skip:
            held[storage._cdata] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = _call(model, x)
    return y, sum(held.values())


def test_a_layer_whose_output_is_smaller_than_its_weight_masks_the_output() -> None:
    """A ViT at a few tokens: qkv's per-head dims (output side) and each branch's depth mask
    in proj and fc2 multiply the layer's output, ``(W x + b) m``, not a copy of the weight and
    bias; the graph then holds about what it holds with every mask on the activations (before: a
    copy of every such weight and bias, 10x the bytes on this model), with the same outputs and
    gradients. At many tokens the weights take the masks again."""
    model, x = _entry("timm_deit_tiny")  # (1, 3, 32, 32): 5 tokens of width 192; qkv (576, 192)
    model.eval()
    runs = {}
    for fold in (True, False):
        net = copy.deepcopy(model)
        s = dms.prepare(net, x, dms.SearchConfig(resource="macs", target=0.5, fold_masks=fold))
        s.gates.train()
        s.randomize_importance(0)
        shadowed = []
        for name in ("blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc2"):
            net.get_submodule(name).register_forward_pre_hook(lambda m, a: shadowed.append("weight" in m.__dict__))
        y, held = _held_for_backward(net, x)
        task_loss(y).backward()
        runs[fold] = (y.detach(), held, [p.grad.clone() for p in s.structure_parameters() if p.grad is not None],
                      list(shadowed))
        if fold:
            shadowed.clear()
            net(x.expand(64, -1, -1, -1))  # 320 tokens: outputs larger than the weights
            assert shadowed == [True, True, True]
    (y_f, held_f, g_f, seen_f), (y_a, held_a, g_a, _) = runs[True], runs[False]
    assert seen_f == [False, False, False]  # nothing folded into a weight at 5 tokens
    assert held_f <= held_a * 1.25, (held_f, held_a)  # (the gathered masks of more keys: a few %)
    torch.testing.assert_close(y_f, y_a, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_f, g_a):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
