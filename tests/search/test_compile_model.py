"""``torch.compile(model)`` of a model prepared for a search computes the eager search.

The gates' forward pre-hook (masks of every dim, the importance hook on their gradient) runs
eagerly (``torch.compiler.disable``); the layers and the masks they read compile. Regression:
before, dynamo traced into the pre-hook, broke the graph at the gradient hook and the second
step failed with "Trying to backward through the graph a second time".
"""

from __future__ import annotations

import copy

import pytest
import torch

import dmscale as dms
from transformer_zoo import TZOO, search_steps
from zoo import ZOO


def _entry(name: str):
    if name in TZOO:
        return TZOO[name].build(), TZOO[name].make_inputs()
    g = torch.Generator().manual_seed(1)
    return ZOO[name].build(), torch.randn((4,) + tuple(ZOO[name].input_shape[1:]), generator=g)


def _eager_and_compiled(base, x):  # noqa: ANN001, ANN202
    """(model, searcher, what to call) of two copies of ``base`` prepared alike, the first eager,
    the second under ``torch.compile(model)`` (``aot_eager``), each after a dynamo reset; the
    model in eval mode (no dropout), the gates training (importance is tracked)."""
    base.eval()
    example = {k: v[:1] for k, v in x.items()} if isinstance(x, dict) else x[:1]
    for compiled in (False, True):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        searcher = dms.prepare(model, example, dms.SearchConfig(resource="macs", target=0.5))
        searcher.gates.train()
        searcher.randomize_importance(0)
        yield model, searcher, torch.compile(model, backend="aot_eager") if compiled else model


@pytest.mark.parametrize("name", ["small_cnn", "hf_bert", "hf_llama_gqa"])
def test_compiled_model_searches_exactly_as_the_eager_one(name):
    base, x = _entry(name)
    results = [search_steps(run, model, x, searcher) for model, searcher, run in _eager_and_compiled(base, x)]
    (y0, imp0, a0), (y1, imp1, a1) = results
    torch.testing.assert_close(y1, y0)
    for a, b in zip(imp1 + a1, imp0 + a0):
        torch.testing.assert_close(a, b)


def _small_vit():
    import timm

    torch.manual_seed(0)
    net = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, depth=2, num_classes=5)
    return net, torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", ["timm_vit_depth2", "hf_llama_gqa", "tv_resnet18", "torch_transformer_encoder"])
def test_the_prepared_model_compiles_to_one_graph(name):
    """``torch.compile(model, fullgraph=True)``: the hooks, folds and masked norms trace
    without a graph break (regression: on torch 2.11 every folded layer broke the graph) and
    the compiled forward and its gradients equal the eager ones. A model with
    ``nn.MultiheadAttention`` (torch's encoder; torchvision's ViT) gets its fused-attention switch
    back after the compiled forward too (regression: the hook that restores it broke the graph,
    and ``fullgraph=True`` failed)."""
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch._dynamo.reset()
    model, x = _small_vit() if name == "timm_vit_depth2" else _entry(name)
    model.eval()
    example = {k: v[:1] for k, v in x.items()} if isinstance(x, dict) else x[:1]
    searcher = dms.prepare(model, example, dms.SearchConfig(resource="macs", target=0.5))
    searcher.randomize_importance(0)
    outs = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        y = run(**x) if isinstance(x, dict) else run(x)
        y = y.logits if hasattr(y, "logits") else y
        y.float().square().mean().backward()
        ratio = next(iter(searcher.structure_parameters()))
        outs.append((y.detach(), ratio.grad.clone()))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-6)
    assert torch.backends.mha.get_fastpath_enabled() == fastpath


# the Llama (~13 s on 2 cores) under -m slow; it compiles in the two tests above in the default run
@pytest.mark.parametrize("name", ["timm_vit_depth2", pytest.param("hf_llama_gqa", marks=pytest.mark.slow)])
def test_a_compiled_search_follows_batches_of_changing_size(name):
    """A smaller last batch (``drop_last=False``) and, for the language model, a shorter
    sequence: dynamo compiles again with dynamic sizes, where each fold's choice between the
    weight and the activation (call by call, by their sizes) becomes a guarded comparison; the
    outputs, ratio gradients and importance equal the eager search's at every size."""
    def batches(x):  # (batch, tokens) sizes the loop sees one after the other
        sizes = [(4, None), (3, None), (4, None), (2, None)] if name != "hf_llama_gqa" else \
            [(2, 12), (1, 12), (2, 9), (2, 12)]
        for b, t in sizes:
            yield {k: v[:b, :t] for k, v in x.items()} if isinstance(x, dict) else x[:b]
    base, x = _small_vit() if name == "timm_vit_depth2" else _entry(name)
    results = []
    for model, searcher, run in _eager_and_compiled(base, x):
        steps = []
        for xb in batches(x):
            model.zero_grad(set_to_none=True)
            y = run(**xb) if isinstance(xb, dict) else run(xb)
            y = y.logits if hasattr(y, "logits") else y
            (y.float().square().mean() + searcher.resource_loss(0.3)).backward()
            steps.append([y.detach()] + [a.grad.clone() for a in searcher.structure_parameters()]
                         + [g.importance.clone() for g in searcher.gates.width])
        results.append(steps)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 2, f"compiled {graphs} graph(s): the changed sizes never reached a compiled graph"
    for eager, compiled in zip(*results):
        for a, b in zip(compiled, eager):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
