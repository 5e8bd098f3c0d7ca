"""The zoo property suite on transformers (issue 4): timm ViTs, Hugging Face Llama (GQA),
GPT-2 and BERT, and torch.nn.TransformerEncoder.

For every model of :data:`transformer_zoo.TZOO`, as in ``test_zoo_properties.py``: open
masks reproduce the original; after real training steps the export computes what the
hardened supernet computes and the differentiable cost at hard masks is the exact count of
the export; every structural parameter gets a task-loss gradient; detach and
apply_structure restore. Transformer-specific: the search space has attention-head dims
(named ``<attention module>.heads``) and one depth block per transformer layer, the
hidden (embedding) dim is searched, tied weights stay tied after export, and for causal
LMs greedy ``generate`` on the export gives the tokens of greedy decoding on the hardened
supernet.

The module-scoped fixture holds one prepared supernet per model; tests run in file order
for each model. Training happens once, lazily (:func:`_ensure_trained`), so any test can
also be run alone.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from transformer_zoo import TZOO, output_tensor, task_loss

import dmscale as dms

MODELS = sorted(TZOO)
CAUSAL_LMS = [n for n in MODELS if TZOO[n].kind == "causal_lm"]

# the module that produces the hidden (embedding / residual-stream) dim of each model
HIDDEN_PRODUCER = {
    "timm_deit_tiny": "patch_embed.proj",
    "timm_vit_small": "patch_embed.proj",
    "hf_llama_gqa": "model.embed_tokens",
    "hf_gpt2": "transformer.wte",
    # BertModel's output *is* the hidden state (last_hidden_state), and a model's outputs
    # are never searched: its hidden dim stays fixed by design
    "hf_bert": None,
    # nn.MultiheadAttention uses one embed_dim for its input, q/k/v and output: fixed
    "torch_transformer_encoder": None,
}
# nn.MultiheadAttention derives head_dim = embed_dim // num_heads: its heads stay fixed
NO_HEADS = {"torch_transformer_encoder"}
# post-norm layers (LN after the residual add) are not x + f(x): removing one is not identity
NO_DEPTH = {"hf_bert"}


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _forward(model: nn.Module, inputs: Any) -> torch.Tensor:
    return output_tensor(_call(model, inputs))


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor (e.g. GPT-2's wte and lm_head), per tensor."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _all_topks(searcher) -> list:
    return list(searcher.gates.width) + list(searcher.gates.depth)


def _randomize_structure(searcher, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in _all_topks(searcher):
            t.a.fill_(float(torch.rand((), generator=g)) * t.max_ratio)


def _ensure_trained(prepared: dict, steps: int = 3) -> None:
    """A few real training steps (task loss + resource loss), once per model, so that
    importance is not flat and the weights are not the initial ones."""
    if prepared["trained"]:
        return
    model, searcher, inputs = prepared["model"], prepared["searcher"], prepared["inputs"]
    model.train()
    opt = torch.optim.SGD([
        {"params": list(searcher.model_parameters()), "lr": 1e-3},
        {"params": list(searcher.structure_parameters()), "lr": 1e-2},
    ])
    for i in range(steps):
        loss = task_loss(_call(model, inputs)) + searcher.resource_loss(progress=0.5 * (i + 1) / steps)  # before the settle phase
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    prepared["trained"] = True


@pytest.fixture(scope="module", params=MODELS)
def prepared(request):
    entry = TZOO[request.param]
    model = entry.build().eval()
    inputs = entry.make_inputs()
    with torch.no_grad():
        reference = _forward(model, inputs)
    keys = list(model.state_dict().keys())
    fresh = copy.deepcopy(model)
    tied = _tied_groups(model)
    searcher = dms.prepare(model, inputs, dms.SearchConfig(resource="macs", target=0.5))
    return dict(name=request.param, entry=entry, model=model, inputs=inputs, reference=reference,
                keys=keys, fresh=fresh, tied=tied, searcher=searcher, trained=False)


# --------------------------------------------------------------------------- search space
def test_search_space_has_heads(prepared):
    searcher, entry = prepared["searcher"], prepared["entry"]
    width = [d.name for d in searcher.space.width]
    assert len(width) > 0, "no width dims found"
    if prepared["name"] in NO_HEADS:
        assert not [n for n in width if n.endswith(".heads")]
        return
    heads = [n for n in width if n.endswith(".heads")]
    assert heads, f"no attention-head dim (named '<attention>.heads') among width dims {width}"
    for layer in entry.layers:
        assert any(n.startswith(layer + ".") for n in heads), (
            f"transformer layer {layer!r} has no '.heads' dim; head dims: {heads}"
        )


def test_timm_attention_searches_the_head_dim(prepared):
    """m_qk = m_v (one dim shared by q, k, v) on timm Attention; fixed elsewhere (see README)."""
    names = [d.name for d in prepared["searcher"].space.width]
    head_dims = [n for n in names if n.endswith(".head_dim")]
    if prepared["name"].startswith("timm_"):
        assert len(head_dims) == len(prepared["entry"].layers)
    else:
        assert head_dims == []


def test_search_space_has_one_depth_block_per_layer(prepared):
    searcher, entry = prepared["searcher"], prepared["entry"]
    depth = {d.name: [b.name for b in d.blocks] for d in searcher.space.depth}
    if prepared["name"] in NO_DEPTH:
        assert depth == {}, "a post-norm layer must not be a removable block"
        return
    assert any(blocks == entry.layers for blocks in depth.values()), (
        f"expected one depth dim whose blocks are the transformer layers {entry.layers}, "
        f"got depth dims {depth}"
    )


def test_search_space_has_hidden_dim(prepared):
    searcher = prepared["searcher"]
    producer = HIDDEN_PRODUCER[prepared["name"]]
    if producer is None:
        pytest.skip("the hidden dim is fixed (model output, or nn.MultiheadAttention)")
    found = [d.name for d in searcher.space.width if producer in d.producers]
    assert found, (
        f"the hidden dim (produced by {producer!r}) is not searched; width dims: "
        f"{[(d.name, d.producers[:3]) for d in searcher.space.width]}; "
        f"pinned: {dict(list(searcher.space.pinned_reasons.items())[:5])}"
    )


# --------------------------------------------------------------------------- properties
def test_open_masks_equal_original(prepared):
    model, searcher, inputs = prepared["model"], prepared["searcher"], prepared["inputs"]
    reference = prepared["reference"]
    if prepared["trained"]:  # weights changed: compare with a hook-free copy of these weights
        with torch.no_grad():
            reference = _forward(dms.detach(copy.deepcopy(model)).eval(), inputs)
    saved = [t.a.detach().clone() for t in _all_topks(searcher)]
    try:
        with torch.no_grad():
            for t in _all_topks(searcher):
                t.a.zero_()
        model.eval()
        with torch.no_grad(), searcher.hardened():
            out = _forward(model, inputs)
    finally:
        with torch.no_grad():
            for t, a in zip(_all_topks(searcher), saved):
                t.a.copy_(a)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)


def test_every_structure_parameter_gets_task_gradient(prepared):
    model, searcher, inputs = prepared["model"], prepared["searcher"], prepared["inputs"]
    _ensure_trained(prepared)
    importance = [t.importance for t in _all_topks(searcher)]
    assert all(float(c.abs().sum()) > 0 for c in importance), "importance was not populated"
    # mid-search: a's fuzzy band (|c' - a| < 3/N) holds live elements, not the dead tail
    with torch.no_grad():
        for t in _all_topks(searcher):
            t.a.fill_(0.4 * t.max_ratio)
    model.train()
    for p in searcher.structure_parameters():
        p.grad = None
    task_loss(_call(model, inputs)).backward()
    names = [d.name for d in searcher.space.width] + [d.name for d in searcher.space.depth]
    gates = [*searcher.gates.width, *searcher.gates.depth]
    assert len(names) == len(gates)
    for name, t in zip(names, gates):
        assert t.ratio_grad is not None and float(t.ratio_grad.abs()) > 0, f"no task gradient for {name}"
    model.eval()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_export_equals_hardened_and_cost_is_exact(prepared, seed):
    model, searcher, inputs = prepared["model"], prepared["searcher"], prepared["inputs"]
    _ensure_trained(prepared)
    _randomize_structure(searcher, seed)
    model.eval()
    with torch.no_grad(), searcher.hardened():
        hard = _forward(model, inputs)
    small = searcher.export().eval()
    assert type(small) is type(prepared["fresh"]), "export must give a model of the same class"
    with torch.no_grad():
        out = _forward(small, inputs)
    torch.testing.assert_close(out, hard, atol=1e-4, rtol=1e-4)
    # the differentiable cost at hard masks is the exact count of the export
    exact = dms.count(small, inputs)
    for resource in ("macs", "params"):
        cost = searcher.costs.exact("hard", resource)
        assert round(cost) == exact[resource], f"{resource}: cost at hard masks {cost} != count of export {exact[resource]}"
    # weights tied in the original (GPT-2's wte / lm_head) are still one tensor
    for names in prepared["tied"]:
        first = small.get_parameter(names[0])
        for other in names[1:]:
            assert small.get_parameter(other) is first, f"export untied {names}"
    # shapes follow the structure; removed blocks hold no weights
    structure = searcher.structure()
    modules = dict(small.named_modules())
    removed = {b["name"] for b in structure["removed_blocks"]}
    renamed = _block_renames(prepared["fresh"], small, removed)
    for name, spec in structure["layers"].items():
        if any(name.startswith(r + ".") for r in removed):
            continue
        w = getattr(modules[_translate(name, renamed)], "weight", None)
        if not isinstance(w, torch.Tensor):
            continue
        if spec["out"] is not None and (spec["handler"] in ("conv", "linear") or w.dim() == 1):
            assert w.shape[0] == len(spec["out"]), name
        if spec["in"] is not None and spec["handler"] in ("conv", "linear") and w.shape[1] != 1:
            assert w.shape[1] == len(spec["in"]), name
    for r in removed:
        now = _translate(r, renamed)
        if now is not None:  # replaced in place (not deleted from its layer list)
            assert not any(True for _ in modules[now].parameters()), f"removed block {r} still has weights"


def _block_renames(fresh: nn.Module, small: nn.Module, removed: set[str]) -> dict[str, str | None]:
    """Old block name -> its name in the export, None when deleted.

    An export may delete removed layers from a layer list (``nn.ModuleList``) instead of
    replacing them in place, e.g. Hugging Face decoder stacks whose layers index the KV cache;
    the kept layers are then renumbered.
    """
    renames: dict[str, str | None] = {}
    by_parent: dict[str, set[str]] = {}
    for r in removed:
        by_parent.setdefault(r.rpartition(".")[0], set()).add(r)
    for parent, gone in by_parent.items():
        old, new = fresh.get_submodule(parent), small.get_submodule(parent)
        if not (isinstance(old, nn.ModuleList) and len(new) == len(old) - len(gone)):
            continue
        j = 0
        for i in range(len(old)):
            name = f"{parent}.{i}"
            if name in gone:
                renames[name] = None
            else:
                renames[name] = f"{parent}.{j}"
                j += 1
    return renames


def _translate(name: str, renames: dict[str, str | None]) -> str | None:
    for old, new in renames.items():
        if name == old or name.startswith(old + "."):
            return None if new is None else new + name[len(old):]
    return name


# --------------------------------------------------------------------------- generation
NEW_TOKENS = 8
TIE_MARGIN = 1e-3  # a top-2 logit gap below this is a numerical tie, not a decision


def _greedy_by_forward(model: nn.Module, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, list[float]]:
    """Greedy decoding by repeated full forward passes (no cache), and each step's top-2 gap."""
    gaps = []
    with torch.no_grad():
        for _ in range(n):
            logits = output_tensor(model(input_ids=ids, use_cache=False))[:, -1].float()
            top = logits.topk(2, dim=-1).values
            gaps.append(float((top[:, 0] - top[:, 1]).min()))
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids, gaps


def _decided_length(prompt_len: int, gaps: list[float]) -> int:
    """Tokens up to (excluding) the first numerically tied step must match exactly."""
    for i, gap in enumerate(gaps):
        if gap < TIE_MARGIN:
            return prompt_len + i
    return prompt_len + len(gaps)


def _lm(prepared) -> tuple[nn.Module, Any, torch.Tensor]:
    if prepared["entry"].kind != "causal_lm":
        pytest.skip("generation is tested on causal LMs only")
    model, searcher = prepared["model"], prepared["searcher"]
    _ensure_trained(prepared)
    # seed 0 prunes heads, the hidden dim and FFNs, and removes layers (llama: 0 and 2,
    # gpt2: 1 and 2), so the export's KV cache has fewer layers than the config had
    _randomize_structure(searcher, 0)
    model.eval()
    return model, searcher, prepared["inputs"]["input_ids"]


def _generate(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              do_sample=False)


def test_export_generate_equals_hardened_greedy(prepared):
    model, searcher, ids = _lm(prepared)
    with searcher.hardened():
        reference, gaps = _greedy_by_forward(model, ids, NEW_TOKENS)
    small = searcher.export().eval()
    assert dms.count(small, ids)["params"] < dms.count(prepared["fresh"], ids)["params"], "nothing was pruned"
    tokens = _generate(small, ids)
    assert tokens.shape == reference.shape, (tokens.shape, reference.shape)
    n = _decided_length(ids.shape[1], gaps)
    assert n > ids.shape[1], f"first generated token is a numerical tie (gaps {gaps})"
    assert torch.equal(tokens[:, :n], reference[:, :n]), f"export {tokens.tolist()} vs hardened {reference.tolist()}"


def test_hardened_supernet_generate(prepared):
    """``generate`` (KV cache) also works on the hooked supernet under hard masks."""
    model, searcher, ids = _lm(prepared)
    with searcher.hardened():
        reference, gaps = _greedy_by_forward(model, ids, NEW_TOKENS)
        tokens = _generate(model, ids)
    n = _decided_length(ids.shape[1], gaps)
    assert tokens.shape == reference.shape, (tokens.shape, reference.shape)
    assert torch.equal(tokens[:, :n], reference[:, :n]), f"generate {tokens.tolist()} vs forward {reference.tolist()}"


# --------------------------------------------------------------------------- restore
def test_apply_structure_and_detach(prepared):
    model, searcher, inputs = prepared["model"], prepared["searcher"], prepared["inputs"]
    _randomize_structure(searcher, 7)
    small = searcher.export()
    structure = searcher.structure()
    again = dms.apply_structure(copy.deepcopy(prepared["fresh"]), structure)
    shapes = {k: tuple(v.shape) for k, v in small.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in again.state_dict().items()} == shapes
    assert searcher.supernet_cost == dms.count(prepared["fresh"], inputs)["macs"]
    dms.detach(model)
    assert list(model.state_dict().keys()) == prepared["keys"]
    assert not hasattr(model, "dms_gates")
    with torch.no_grad():
        out = _forward(model.eval(), inputs)
    # training steps may have changed the weights: compare with the same weights, no hooks
    with torch.no_grad():
        plain = _forward(copy.deepcopy(model), inputs)
    torch.testing.assert_close(out, plain)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
