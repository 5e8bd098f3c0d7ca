"""Masked norms under torch.compile (``SearchConfig(fuse_norms=True)``, dmscale.core.fused_norms).

The default tests compile with the ``aot_eager`` backend (the same dynamo and AOTAutograd graphs
as inductor, no kernel compiler; seconds); the slow test counts inductor's kernels.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import dmscale as dms
from dmscale.core import fused_norms
from dmscale.core.masked_norm import mask_weights, masked_layer_norm, masked_rms_norm, masked_rms_rescale
from transformer_zoo import TZOO, search_steps


@pytest.fixture
def aot_eager(monkeypatch):
    """Fusion compiled with aot_eager, a fresh cache and no earlier failure."""
    monkeypatch.setattr(fused_norms, "FUSE_BACKEND", "aot_eager")
    monkeypatch.setattr(fused_norms, "_compiled", {})
    monkeypatch.setattr(fused_norms, "_failure", [])
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _grads(*ts: torch.Tensor) -> list[torch.Tensor]:
    out = [t.grad.clone() for t in ts]
    for t in ts:
        t.grad = None
    return out


def test_fused_layer_norm_equals_the_eager_function(aot_eager):
    g = torch.Generator().manual_seed(0)
    x, m = torch.randn(2, 7, 16, generator=g, requires_grad=True), torch.rand(16, generator=g, requires_grad=True)
    w, b = torch.randn(16, generator=g, requires_grad=True), torch.randn(16, generator=g, requires_grad=True)
    gy = torch.randn(2, 7, 16, generator=g)
    masked_layer_norm(x, m, w, b, 1e-5).backward(gy)
    eager = _grads(x, m, w, b)
    y = fused_norms.layer_norm(x, mask_weights(m), w, b, 1e-5, fuse=True)
    y.backward(gy)
    torch.testing.assert_close(y, masked_layer_norm(x, m, w, b, 1e-5))
    for a, e in zip(_grads(x, m, w, b), eager):
        torch.testing.assert_close(a, e)
    assert counters["stats"]["unique_graphs"] == 1


def test_fused_rms_rescale_recomputes_through_the_norm_module_and_equals_the_eager_function(aot_eager):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    norms = [LlamaRMSNorm(16, eps=1e-5) for _ in range(3)]
    for n in norms:
        n.weight.data.normal_(generator=g)
    m = torch.rand(16, generator=g, requires_grad=True)
    for i, norm in enumerate(norms):  # three modules and three lengths: one graph
        x = torch.randn(2, 5 + i, 16, generator=g, requires_grad=True)
        gy = torch.randn(2, 5 + i, 16, generator=g)
        masked_rms_rescale(norm(x), x, m, 1e-5, norm.forward).backward(gy)
        eager = _grads(x, m, norm.weight)
        y = fused_norms.rms_rescale(norm(x), x, mask_weights(m), 1e-5, norm, fuse=True)
        y.backward(gy)
        for a, e in zip(_grads(x, m, norm.weight), eager):
            torch.testing.assert_close(a, e)
    assert counters["stats"]["unique_graphs"] == 1


def test_auto_fuses_on_cuda_only_and_never_on_meta_or_fake_tensors(aot_eager):
    x = torch.randn(2, 3, 8)
    assert not fused_norms._fusable(None, x) and fused_norms._fusable(True, x)
    assert not fused_norms._fusable(True, x.to("meta"))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        y = fused_norms.layer_norm(torch.randn(2, 3, 8), mask_weights(torch.rand(8)), None, None, 1e-5, fuse=True)
    assert y.shape == (2, 3, 8) and not fused_norms._compiled


def test_a_failed_compilation_warns_once_and_runs_eagerly(aot_eager, monkeypatch):
    def broken(gm, example_inputs):
        raise RuntimeError("no kernel compiler here")
    monkeypatch.setattr(fused_norms, "FUSE_BACKEND", broken)
    x, m = torch.randn(2, 3, 8), torch.rand(8)
    with pytest.warns(RuntimeWarning, match="no kernel compiler here"):
        y = fused_norms.layer_norm(x, mask_weights(m), None, None, 1e-5, fuse=True)
    torch.testing.assert_close(y, masked_layer_norm(x, m, None, None, 1e-5))
    assert "no kernel compiler here" in fused_norms.fusion_failure()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second attempt
        fused_norms.layer_norm(x, mask_weights(m), None, None, 1e-5, fuse=True)


def test_a_fused_call_builds_no_tensor_from_eps_or_offset(aot_eager):
    """eps and the RMS offset are constants of the compiled graph: passed as floats, dynamo made
    each an input built as a 0-d tensor on every call (torch.as_tensor: empty, to, lift_fresh),
    3 operators per float per norm, 360 per step of a 30-layer Llama. (A rescaled norm of a
    class the search does not know still reads its own eps attribute inside the graph.)"""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(0)
    x, m = torch.randn(2, 5, 16, generator=g, requires_grad=True), torch.rand(16, generator=g, requires_grad=True)
    w, b = torch.randn(16, generator=g, requires_grad=True), torch.randn(16, generator=g, requires_grad=True)
    p = mask_weights(m)

    def calls() -> list[torch.Tensor]:
        return [fused_norms.layer_norm(x, p, w, b, 1e-6, fuse=True),
                fused_norms.rms_norm(x, p, w, 1e-5, 1.0, torch.float32, fuse=True)]

    calls()  # compiles
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ys = calls()
    assert fused_norms.fusion_failure() is None
    assert fused_norms.fusion_state()["compiled"] == ["layer_norm", "rms_norm"]
    assert [e.name for e in prof.events() if e.name in ("aten::lift_fresh", "aten::as_tensor")] == []
    torch.testing.assert_close(ys[0], masked_layer_norm(x, m, w, b, 1e-6))
    torch.testing.assert_close(ys[1], masked_rms_norm(x, m, w, 1e-5, 1.0, torch.float32))


def test_norms_of_many_widths_in_one_process_all_run_compiled(aot_eager):
    # dynamo specialises a graph on the channel count (a norm's weight is a static parameter)
    # and, under fullgraph=True, raised FailOnRecompileLimitHit at the ninth width: every
    # configuration now compiles a copy of its own
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    for c in range(8, 17):  # nine widths: one past the limit of 8 recompilations
        x, m = torch.randn(2, 3, c, generator=g), torch.rand(c, generator=g, requires_grad=True)
        norm = LlamaRMSNorm(c, eps=1e-6)  # its weight, a parameter, makes the width static
        y = fused_norms.rms_rescale(norm(x), x, mask_weights(m), 1e-6, norm, fuse=True)
        torch.testing.assert_close(y, masked_rms_rescale(norm(x), x, m, 1e-6, norm.forward))
    assert fused_norms.fusion_failure() is None and fused_norms.fusion_state()["compiled"] == ["rms_rescale"]


def test_warnings_as_errors_do_not_stop_the_fusion(aot_eager):
    # torch's own warnings while dynamo traces (it reads .grad of the non-leaf activation) were
    # errors under -W error: the fusion failed and its RuntimeWarning was raised in the forward
    x = torch.randn(2, 3, 8, requires_grad=True) * 2  # a non-leaf activation, as in a model
    m = torch.rand(8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = fused_norms.layer_norm(x, mask_weights(m), None, None, 1e-5, fuse=True)
        y.sum().backward()
    assert fused_norms.fusion_failure() is None and fused_norms._compiled


@pytest.mark.parametrize("name", ["timm_deit_tiny", "hf_llama_gqa"])
def test_a_search_with_fused_norms_equals_the_eager_search(aot_eager, name):
    entry = TZOO[name]
    base, x = entry.build(), entry.make_inputs()
    example = {k: v[:1] for k, v in x.items()} if isinstance(x, dict) else x[:1]
    results = []
    for fuse in (False, True):
        model = copy.deepcopy(base)
        searcher = dms.prepare(model, example, dms.SearchConfig(resource="macs", target=0.5, fuse_norms=fuse))
        searcher.gates.train()
        searcher.randomize_importance(0)
        results.append((*search_steps(model, model, x, searcher), searcher.structure()))
    (y0, imp0, a0, s0), (y1, imp1, a1, s1) = results
    assert fused_norms._compiled and fused_norms.fusion_failure() is None  # it did run fused
    torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-5)
    for a, b in zip(imp1 + a1, imp0 + a0):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
    assert s1 == s0
    assert counters["stats"]["unique_graphs"] <= 4  # one per function and grad mode, not one per norm


def test_inside_a_compiled_model_the_norms_are_part_of_its_graph(aot_eager):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3).eval()
    x = torch.randn(2, 3, 16, 16)
    dms.prepare(model, x[:1], dms.SearchConfig(resource="macs", target=0.5, fuse_norms=True))
    fused_norms._compiled.clear()  # (prepare's self-check ran the norms fused)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    assert not fused_norms._compiled  # no nested compilation of its own


def test_fuse_norms_is_checked_and_reaches_the_gates_and_the_command_line():
    from dmscale.core.errors import ConfigError
    with pytest.raises(ConfigError, match="fuse_norms: expected true or false, got 'sometimes'"):
        dms.SearchConfig(fuse_norms="sometimes")
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig(fuse_norms=False))
    assert s.gates.fuse_norms is False
    from dmscale.config.run_config import RunConfig
    from dmscale.run.saved_runs import search_config
    assert search_config(RunConfig(fuse_norms=True, resource_weight=1.0), []).fuse_norms is True


@pytest.mark.slow
def test_inductor_fuses_a_masked_layer_norm_into_few_kernels(monkeypatch):
    import torch._inductor.config as inductor_config

    from bench import search_proxies

    monkeypatch.setattr(fused_norms, "_compiled", {})
    monkeypatch.setattr(fused_norms, "_failure", [])
    monkeypatch.setattr(inductor_config.cpp, "enable_kernel_profile", True)
    x, w, b = (torch.randn(*s, requires_grad=True) for s in ((4, 9, 32), (32,), (32,)))
    p = mask_weights(torch.rand(32)).requires_grad_()  # the norm's own operators, not the weights'

    def step(fuse: bool) -> None:
        for t in (x, p, w, b):
            t.grad = None  # no gradient accumulation counted
        fused_norms.layer_norm(x, p, w, b, 1e-5, fuse=fuse).sum().backward()
    step(True)
    eager = sum(search_proxies.launching_operators(lambda: step(False)).values())
    fused = search_proxies.launching_operators(lambda: step(True))
    # measured 24 operators eager; fused 2 kernels, the sum, its backward and a contiguous
    assert fused["kernel"] >= 1 and sum(fused.values()) <= eager / 4, (eager, fused)


def test_reset_forgets_what_ran_compiled_and_the_failure(aot_eager):
    x, m = torch.randn(2, 3, 8), torch.rand(8)
    fused_norms.layer_norm(x, mask_weights(m), None, None, 1e-5, fuse=True)
    assert fused_norms.fusion_state() == {"compiled": ["layer_norm"], "failure": None}
    fused_norms._failure.append("RuntimeError: earlier")
    fused_norms.reset_fusion()
    assert fused_norms.fusion_state() is None and fused_norms._fusable(True, x)


def _tiny_causal_lm(family: str) -> torch.nn.Module:
    import transformers as T
    configs = {"qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}), "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {}),
               "mistral": (T.MistralConfig, T.MistralForCausalLM, {}), "gemma": (T.GemmaConfig, T.GemmaForCausalLM, {}),
               "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, {}),
               "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, {}),
               "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, {"n_embd": 32, "n_layer": 2, "n_head": 4})}
    config, model, extra = configs[family]
    kwargs = extra or {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 8}
    torch.manual_seed(0)
    return model(config(vocab_size=60, **kwargs)).train()


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) for f in
                                    ("qwen2", "qwen3", "mistral", "gemma", "gemma2", "gpt2")] + ["gemma3"])
def test_every_family_s_norms_trace_and_fuse(aot_eager, family):
    """Each family's norm module traces into the compiled RMS backward (Gemma's 1 + weight,
    Qwen3's q/k norms) or LayerNorm; one step equals the eager one."""
    base, x = _tiny_causal_lm(family), torch.randint(0, 60, (2, 10), generator=torch.Generator().manual_seed(0))
    grads = []
    for fuse in (False, True):
        model = copy.deepcopy(base)
        searcher = dms.prepare(model, {"input_ids": x[:1]}, dms.SearchConfig(target=0.7, fuse_norms=fuse))
        torch.manual_seed(1)  # the same dropout
        (model(input_ids=x).logits.float().pow(2).mean() + searcher.resource_loss(0.3)).backward()
        grads.append([a.grad.clone() for a in searcher.structure_parameters()])
    state = fused_norms.fusion_state()
    assert state is not None and state["compiled"] and state["failure"] is None, state
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_a_backward_that_fails_to_compile_fails_at_the_call_not_in_backward(aot_eager, monkeypatch):
    from torch._dynamo.backends.common import aot_autograd

    def boom(gm, example_inputs):
        raise RuntimeError("no backward kernels")
    monkeypatch.setattr(fused_norms, "FUSE_BACKEND", aot_autograd(fw_compiler=lambda gm, ex: gm, bw_compiler=boom))
    x, m = torch.randn(2, 3, 8, requires_grad=True), torch.rand(8, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="no backward kernels"):
        y = fused_norms.layer_norm(x, mask_weights(m), None, None, 1e-5, fuse=True)
    y.sum().backward()  # the eager function's backward
    assert x.grad is not None and m.grad is not None
