"""The width gates' ratios in one Parameter (dmscale.core.ratios): the same search as one
Parameter per gate, old checkpoints load, tied dims share an entry."""

from __future__ import annotations

import copy

import torch
from torch import nn
from zoo import ZOO

import dmscale as dms
from dmscale.core.ratios import STORE, ratio_key, stack_ratios
from dmscale.core.topk import DifferentiableTopK


def _unstack(searcher) -> None:
    """Give every width gate its own () Parameter again (what the gates were before)."""
    gates = searcher.gates
    for t in gates.width:
        value = t.a.detach().clone()
        t.__dict__.pop("_ratio_slot")
        t.a = nn.Parameter(value)
    del gates._parameters[STORE]


def _model(name: str) -> tuple[nn.Module, torch.Tensor]:
    entry = ZOO[name]
    return entry.build(), torch.randn(2, *entry.input_shape[1:], generator=torch.Generator().manual_seed(0))


def _search(name: str = "resnet20"):
    model, x = _model(name)
    s = dms.prepare(model, x, dms.SearchConfig(resource="macs", target=0.5))
    return model, x, s


def test_width_ratios_are_one_parameter_and_each_gate_reads_its_entry():
    model, x, s = _search()
    store = s.gates.width_ratios
    names = [n for n, _ in model.named_parameters() if n.startswith("dms_gates.")]
    assert names == ["dms_gates.width_ratios"] + [f"dms_gates.depth.{j}.a" for j in range(len(s.gates.depth))]
    assert store.shape == (len(s.gates.width),) and store.dtype == torch.float32
    assert list(s.structure_parameters()) == [store, *[t.a for t in s.gates.depth]]
    with torch.no_grad():
        s.gates.width[2].a.fill_(0.375)  # a write through the view lands in the entry
    assert float(store[2]) == 0.375 and s.gates.width[2].hard_count() == round(0.625 * s.gates.width[2].n_units)
    bank, which = s.gates._bank_for()
    assert bank._store is store and bank._own == [t.a for t in s.gates.depth]
    # the forward's masks read the Parameter as it is: one cat of it and the depth ratios' stack
    cat = bank.ratios().grad_fn.next_functions[0][0]
    assert type(cat).__name__ == "CatBackward0" and cat.next_functions[0][0].variable is store
    model(x).square().mean().backward()
    grad = store.grad
    assert grad is not None and grad.shape == store.shape
    assert all(torch.equal(t.ratio_grad, grad[i]) for i, t in enumerate(s.gates.width))
    assert all(t.ratio_grad is t.a.grad for t in s.gates.depth)


def test_stacked_ratios_give_the_search_of_one_parameter_per_gate():
    """Three steps (SGD on the weights, Adam on the ratios, task + resource loss) with the
    ratios stacked and with one Parameter per gate: the same ratios, importance and outputs."""
    model, x = _model("tv_resnet18")
    runs = []
    for stacked in (True, False):
        m = copy.deepcopy(model)
        s = dms.prepare(m, x, dms.SearchConfig(resource="macs", target=0.5))
        if not stacked:
            _unstack(s)
            params = list(s.structure_parameters())
            assert all(p.dim() == 0 for p in params) and len(params) == len(s.gates.width) + len(s.gates.depth)
        opt_w = torch.optim.SGD(s.model_parameters(), lr=1e-3)
        opt_s = torch.optim.Adam(s.structure_parameters(), lr=0.05)
        outs = []
        for step in range(3):
            opt_w.zero_grad(), opt_s.zero_grad()
            y = m(x)
            (y.square().mean() + s.resource_loss(step / 3)).backward()
            opt_w.step(), opt_s.step()
            outs.append(y.detach())
        ratios = torch.stack([t.a.detach() for t in (*s.gates.width, *s.gates.depth)])
        runs.append((ratios, [t.importance.clone() for t in s.gates.width], outs, s.structure()))
    (r1, c1, y1, f1), (r2, c2, y2, f2) = runs
    torch.testing.assert_close(r1, r2, rtol=1e-6, atol=1e-7)
    for a, b in zip(c1, c2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)
    for a, b in zip(y1, y2):
        torch.testing.assert_close(a, b)
    assert f1 == f2


def test_a_checkpoint_with_one_ratio_per_gate_loads_into_the_stacked_ratios():
    model, x, s = _search()
    with torch.no_grad():
        for i, t in enumerate(s.gates.width):
            t.a.fill_(0.05 * (i % 7))
    expected = s.gates.width_ratios.detach().clone()
    # the state dict an earlier version wrote: one "dms_gates.width.{j}.a" per gate, no stacked key
    state = {k: v.clone() for k, v in model.state_dict().items()}
    values = state.pop("dms_gates." + STORE)
    for j, t in enumerate(s.gates.width):
        state[f"dms_gates.width.{j}.a"] = values[t.__dict__["_ratio_slot"][2]].clone()
    with torch.no_grad():
        s.gates.width_ratios.zero_()
    model.load_state_dict(state)  # strict: every old key is used, none missing
    assert torch.equal(s.gates.width_ratios, expected)
    del state["dms_gates.width.0.a"]  # incomplete: the stacked key is reported missing
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        assert "dms_gates.width_ratios" in str(e) and "dms_gates.width.1.a" in str(e)
    else:
        raise AssertionError("an incomplete old checkpoint loaded")


def test_tied_dims_share_one_entry_and_the_rest_are_rebuilt_without_gaps():
    gates = nn.Module()
    gates.width = nn.ModuleList([DifferentiableTopK(4), DifferentiableTopK(4), DifferentiableTopK(6)])
    with torch.no_grad():
        gates.width[2].a.fill_(0.5)
    stack_ratios(gates, list(gates.width))
    from dmscale.search.uniform import tie_ratios

    tie_ratios(list(gates.width), [[0, 1]])
    assert ratio_key(gates.width[0]) == ratio_key(gates.width[1]) != ratio_key(gates.width[2])
    stack_ratios(gates, list(gates.width))  # (what prepare does after tying)
    assert gates.width_ratios.tolist() == [0.0, 0.5]
    with torch.no_grad():
        gates.width[1].a.fill_(0.25)
    assert float(gates.width[0].a.detach()) == 0.25


def test_a_gate_without_a_ratio_says_so_and_a_fresh_gate_keeps_its_own_parameter():
    t = DifferentiableTopK(3)
    assert isinstance(t.a, nn.Parameter) and t.ratio_leaf() == (t.a, None) and t.ratio_grad is None
    del t._parameters["a"]
    assert not hasattr(t, "a")


def test_replacing_the_stacked_ratios_rebuilds_the_bank():
    model, x, s = _search()
    bank = s.gates._bank_for()[0]
    state = {k: v.clone() + (0.1 if k.endswith(STORE) else 0) for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # a new Parameter object
    new_bank = s.gates._bank_for()[0]
    assert new_bank is not bank and new_bank._store is s.gates.width_ratios
    assert torch.equal(new_bank.ratios()[: len(s.gates.width), 0], s.gates.width_ratios.detach())
