"""Every weight fold of a forward in one autograd node (dmscale.core.fold_batch, issue 29).

The batch must compute what the layers' own fold hooks compute: the same outputs to the bit,
the same gradients of the weights, the ratios and the importances, on real models (torchvision,
timm, Hugging Face), with layers that multiply their activation instead, shared layers and
activation checkpointing; and a forward's folds must be one node.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import dmscale as dms
from dmscale.core import fold_batch
from dmscale.core.fold_batch import CHUNKS, FoldAll, FoldPlan, Multiply
from transformer_zoo import TZOO, output_tensor, task_loss
from zoo import ZOO

# "+long": as many token rows as the weights have entries, so the transformer's folds take the weights
MODELS = ["tv_resnet18", "tv_mobilenet_v2", "timm_efficientnet_b0", "timm_vit_small", "hf_llama_gqa", "hf_gpt2",
          "hf_llama_gqa+long"]


def test_fold_all_matches_the_multiplies_and_passes_gradcheck():
    g = torch.Generator().manual_seed(0)
    d = torch.float64
    w = torch.randn(4, 3, 2, 2, dtype=d, generator=g).requires_grad_()  # conv: input, output and depth folds
    b = torch.randn(4, dtype=d, generator=g).requires_grad_()  # its bias: output and depth folds
    lin = torch.randn(5, 4, dtype=d, generator=g).requires_grad_()  # linear: input fold
    block = torch.rand(18, dtype=d, generator=g).requires_grad_()  # segments 3, 4, 4, 4, 3 (the last copied)
    depth = torch.rand(3, dtype=d, generator=g).requires_grad_()
    plan = FoldPlan([3, 4, 4, 4, 3], [
        [Multiply(0, "c", 0, 2, (0, 2, 3)), Multiply(1, "c", 2, 0, ()), Multiply(2, "c", 3, 0, (0,))],
        [Multiply(0, "c", 1, 3, (1, 2, 3)), Multiply(1, "d", 1, 0, (0,))],
        [Multiply(0, "d", 1, 0, (0, 1, 2, 3))],
    ], copies=[4])

    def fold(block, depth, w, b, lin):
        return FoldAll.apply(plan, block, depth, w, b, lin)

    s = block.split([3, 4, 4, 4, 3])
    expected = (w * s[0].view(3, 1, 1) * s[1].view(4, 1, 1, 1) * depth[1], b * s[2] * depth[1], lin * s[3], s[4])
    for got, want in zip(fold(block, depth, w, b, lin), expected):
        assert torch.equal(got, want)
    assert torch.autograd.gradcheck(fold, (block, depth, w, b, lin))


def _entry(name: str) -> tuple[nn.Module, Any]:
    if name in TZOO:
        entry = TZOO[name]
        return entry.build(), entry.make_inputs()
    entry = ZOO[name]
    return entry.build(), torch.randn((4,) + tuple(entry.input_shape[1:]), generator=torch.Generator().manual_seed(1))


def _call(model: nn.Module, x: Any) -> torch.Tensor:
    return output_tensor(model(**x) if isinstance(x, dict) else model(x))


def _prepared(name: str) -> tuple[nn.Module, dms.Searcher, Any]:
    model, x = _entry(name.removesuffix("+long"))
    model.eval()  # no dropout: two forwards must see the same function
    example = {k: v[:1] for k, v in x.items()} if isinstance(x, dict) else x[:1]
    s = dms.prepare(model, example, dms.SearchConfig(resource="macs", target=0.5))
    s.gates.train()
    s.randomize_importance(0)
    with torch.no_grad():
        for i, t in enumerate([*s.gates.width, *s.gates.depth]):
            t.a.fill_(0.15 + 0.05 * (i % 5))
    return model, s, x


def _steps(model: nn.Module, s: dms.Searcher, x: Any, steps: int = 2) -> list[Any]:
    """Outputs, weight and ratio gradients and importances after each of ``steps`` SGD steps."""
    opt = torch.optim.SGD([*s.model_parameters(), *s.structure_parameters()], lr=1e-3)
    found = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        y = _call(model, x)
        (task_loss(y) + s.resource_loss(0.5)).backward()
        found.append((y.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()],
                      [t.importance.clone() for t in [*s.gates.width, *s.gates.depth]]))
        opt.step()
    return found


def _per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer folds on its own: the batch switched off (what bench/gpu_check.py's
    --per-layer-folds rows run)."""
    monkeypatch.setattr(fold_batch, "ENABLED", False)


def _fold_nodes(loss: torch.Tensor) -> Counter:
    seen, stack, count = set(), [loss.grad_fn], Counter()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count[type(node).__name__] += 1
        stack.extend(n for n, _ in node.next_functions)
    return count


@pytest.mark.parametrize("name", MODELS)
def test_the_batch_computes_what_each_layer_folding_alone_computes(name, monkeypatch):
    model, s, x = _prepared(name)
    x = _long(model, x) if name.endswith("+long") else x
    batched = _steps(model, s, x)
    nodes = _fold_nodes(task_loss(_call(model, x)))
    assert 1 <= nodes["FoldAllBackward"] <= CHUNKS + 1, nodes  # a few nodes, not one per fold
    with monkeypatch.context() as mp:
        _per_layer(mp)
        model2, s2, _ = _prepared(name)
        alone = _steps(model2, s2, x)
        assert _fold_nodes(task_loss(_call(model2, x)))["FoldAllBackward"] == 0
    for step, ((y_b, g_b, i_b), (y_a, g_a, i_a)) in enumerate(zip(batched, alone)):
        torch.testing.assert_close(y_b, y_a, rtol=0, atol=0, msg=f"{name}: outputs, step {step}")
        for p, q in zip(g_b, g_a):
            assert (p is None) == (q is None)
            if p is not None:
                # (a ratio's gradient sums many terms, which the engine adds in another order)
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=f"{name}: gradients, step {step}")
        for p, q in zip(i_b, i_a):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-12, msg=f"{name}: importance, step {step}")


def test_layers_that_multiply_their_activation_read_their_masks_from_the_batch():
    """A layer whose input is smaller than its weight (a ViT at a few tokens) multiplies the input
    and leaves the next forward's batch, which hands out its masks instead (one node for all)."""
    model, s, x = _prepared("timm_vit_small")
    _steps(model, s, x)
    chunks, _ = s.gates.forward_masks.fold_cache["made"]
    copied = [k for c in chunks for k in c.copied]
    assert copied and all(k in s.gates.forward_masks.layout.keys[:s.gates.forward_masks.layout.n_block] for k in copied)


def _long(model: nn.Module, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inputs with as many token rows as the layers' weights have entries: every fold takes the
    weight (at the zoo's few tokens every layer multiplies its activation instead)."""
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, **({"attention_mask": torch.ones_like(ids)} if "attention_mask" in x else {})}


def test_the_batch_lets_go_of_each_folded_weight_after_its_layer_and_stays_out_of_checkpoints():
    """Each folded weight is held until its layer's call only, and made with its quarter of the
    model (not all at the forward's start); layers under activation checkpointing fold on their
    own (their recomputation in the backward folds again, as without the batch)."""
    model, s, x = _prepared("hf_llama_gqa")
    model.train()
    x = _long(model, x)
    _call(model, x)  # (after prepare's one-token forwards every layer took its activation: now the weights)
    _call(model, x)
    folds = s.gates.forward_masks._folded
    assert folds.done and len(folds.done) == len(folds.chunks) == 1  # a small model: one node
    assert not [k for k in folds.found if isinstance(k, int)]  # every layer's entry read once and dropped
    assert not [k for k in folds.found if isinstance(k, str)]  # no layer took its activation
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    nodes = _fold_nodes(task_loss(_call(model, x)))
    assert nodes["FoldAllBackward"] <= 1 and nodes["MulBackward0"] > 10, nodes  # the lm head outside batched


def test_activation_checkpointing_gives_the_batched_search():
    """Non-reentrant checkpointing (Hugging Face's gradient checkpointing) of a Llama: the
    checkpointed layers fold on their own; outputs and gradients as without checkpointing."""
    found = []
    for checkpointing in (False, True):
        model, s, x = _prepared("hf_llama_gqa")
        model.train()
        x = _long(model, x)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        found.append(_steps(model, s, x))
    for (y_a, g_a, i_a), (y_b, g_b, i_b) in zip(*found):
        torch.testing.assert_close(y_a, y_b, rtol=0, atol=0)
        for p, q in zip(g_a + i_a, g_b + i_b):
            assert (p is None) == (q is None)
            if p is not None:
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9)


def test_a_large_model_is_folded_in_quarters_in_its_order(monkeypatch):
    """Four nodes of about equal weight bytes, in the layers' order: a node's backward (and
    DDP's all-reduce of its weights' gradients) need not wait for the whole backward."""
    monkeypatch.setattr(fold_batch, "MIN_CHUNK_BYTES", 1)
    model, s, x = _prepared("hf_llama_gqa")
    x = _long(model, x)
    _call(model, x), _call(model, x)
    folds = s.gates.forward_masks._folded
    assert len(folds.chunks) in (CHUNKS, CHUNKS + 1) and folds.done == set(range(len(folds.chunks)))
    order = [id(u) for _, u in s.gates.forward_masks.fold_layers]
    where = [folds.where[i] for i in order if i in folds.where]
    assert where == sorted(where)
    nodes = _fold_nodes(task_loss(_call(model, x)))
    assert nodes["FoldAllBackward"] == len(folds.chunks)
