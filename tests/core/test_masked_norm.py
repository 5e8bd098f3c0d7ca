"""The masked LayerNorm's closed-form backward equals autograd through its definition."""

from __future__ import annotations

import pytest
import torch

from dmscale.core.masked_norm import masked_layer_norm


def _definition(x, m, w, b, eps):
    """Mask-weighted mean and variance written out (what the search computed before)."""
    xf = x.float()
    total = m.sum()
    mean = (xf * m).sum(-1, keepdim=True) / total
    var = (((xf - mean) ** 2) * m).sum(-1, keepdim=True) / total
    y = (xf - mean) * torch.rsqrt(var + eps)
    y = y * w if w is not None else y
    return (y + b if b is not None else y).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_masked_layer_norm_matches_its_definition_forward_and_backward(dtype, affine):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 24, generator=g) * 2 + 0.5).to(dtype).requires_grad_()
    m = torch.rand(24, generator=g).requires_grad_()
    w = torch.randn(24, generator=g).requires_grad_() if affine else None
    b = torch.randn(24, generator=g).requires_grad_() if affine else None
    inputs = [t for t in (x, m, w, b) if t is not None]
    y = masked_layer_norm(x, m, w, b, 1e-5)
    ref = _definition(x, m, w, b, 1e-5)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-5, atol=1e-5)
    gy = torch.randn(y.shape, generator=g).to(dtype)
    for got, want in zip(torch.autograd.grad(y, inputs, gy), torch.autograd.grad(ref, inputs, gy)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_masked_layer_norm_gradcheck_in_float64():
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(2, 3, 6, generator=g, dtype=torch.float64), torch.rand(6, generator=g, dtype=torch.float64),
            torch.randn(6, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)]
    assert torch.autograd.gradcheck(lambda *a: masked_layer_norm(*a, eps=1e-3), [a.requires_grad_() for a in args])


def test_masked_layer_norm_under_bf16_autocast_computes_in_float32():
    """Regression: under autocast the matrix products of the backward ran in bfloat16 and
    ``linalg.vecdot`` refused the mixed dtypes."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, 16, generator=g).requires_grad_()
    m, w, b = (torch.rand(16, generator=g).requires_grad_() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = masked_layer_norm(x, m, w, b, 1e-5)
    assert y.dtype == torch.float32
    grads = torch.autograd.grad(y.sum(), (x, m, w, b))
    want = torch.autograd.grad(_definition(x, m, w, b, 1e-5).sum(), (x, m, w, b))
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def _rms_definition(out, x, m, eps):
    """The rescale as the search computed it before: elementwise, in float32."""
    xf = x.float()
    ms_kept = (xf * xf * m).sum(-1, keepdim=True) / m.sum()
    ms_all = (xf * xf).mean(-1, keepdim=True)
    return (out.float() * torch.rsqrt(ms_kept + eps) / torch.rsqrt(ms_all + eps)).to(out.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_rms_rescale_matches_its_definition_forward_and_backward(dtype):
    from dmscale.core.masked_norm import masked_rms_rescale
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 5, 24, generator=g) + 0.3).requires_grad_()
    gain = torch.randn(24, generator=g)
    out = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain).to(dtype)
    m = torch.rand(24, generator=g).requires_grad_()
    y = masked_rms_rescale(out, x, m, 1e-6)
    ref = _rms_definition(out, x, m, 1e-6)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-5, atol=1e-5)
    gy = torch.randn(y.shape, generator=g).to(dtype)
    got_all = torch.autograd.grad(y, (x, m), gy, retain_graph=True)  # out's graph is shared
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # bfloat16 output: its rounding, either way
    for got, want in zip(got_all, torch.autograd.grad(ref, (x, m), gy)):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))


def test_masked_rms_rescale_gradcheck_in_float64():
    from dmscale.core.masked_norm import masked_rms_rescale
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 6, generator=g, dtype=torch.float64).requires_grad_()
    out = torch.randn(2, 3, 6, generator=g, dtype=torch.float64).requires_grad_()
    m = torch.rand(6, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda o, a, b: masked_rms_rescale(o, a, b, 1e-3), (out, x, m))


def test_masked_rms_rescale_recomputes_the_norm_instead_of_keeping_its_output():
    """Given the norm's forward, the rescale keeps no activation beyond the input the norm's
    own backward holds (one fewer per norm) and gives the gradients of the kept-output form."""
    from dmscale.core.masked_norm import masked_rms_rescale
    g = torch.Generator().manual_seed(5)
    norm = torch.nn.RMSNorm(6, eps=1e-3, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    x = torch.randn(2, 3, 6, generator=g, dtype=torch.float64).requires_grad_()
    m = torch.rand(6, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: masked_rms_rescale(norm(a), a, b, 1e-3, norm.forward), (x, m))
    grads = []
    for recompute in (norm.forward, None):
        y = masked_rms_rescale(norm(x), x, m, 1e-3, recompute)
        node_saved = [t for t in y.grad_fn.saved_tensors if t.shape == x.shape]
        assert len(node_saved) == (1 if recompute is not None else 2)  # x alone, or x and y
        grads.append(torch.autograd.grad(y.pow(2).sum(), (x, m, norm.weight)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_an_rms_norm_with_a_user_forward_hook_keeps_its_output_for_the_backward():
    """A hook that changes the norm's output means ``forward(x)`` no longer gives what the
    rescale saw: the searcher's hook then keeps the output instead of computing it again."""
    from dmscale.core.hook_base import DMSHook
    from dmscale.core.mask_hooks import _recomputable
    norm = torch.nn.RMSNorm(4)
    x = torch.randn(2, 4)
    assert _recomputable(norm, (x,), {})

    class Passive(DMSHook):  # dmscale's own hooks do not count
        def __call__(self, module, args, out):
            return None
    norm.register_forward_hook(Passive())
    assert _recomputable(norm, (x,), {})
    handle = norm.register_forward_hook(lambda mod, a, out: out * 2)
    assert not _recomputable(norm, (x,), {}) and not _recomputable(torch.nn.RMSNorm(4), (x,), {"eps": 1.0})
    handle.remove()


@pytest.mark.parametrize("which", ["layer_norm", "rms_rescale", "rms_rescale_kept", "rms_norm", "weights"])
def test_a_second_derivative_through_a_masked_norm_is_refused(which):
    """Regression: these backwards use statistics saved without their graph; under
    create_graph=True they gave a wrong second derivative without a word (gradgradcheck failed
    for the LayerNorm, the rescale keeping its output and the weights p)."""
    from dmscale.core.masked_norm import mask_weights, masked_rms_norm, masked_rms_rescale
    norm = torch.nn.RMSNorm(4)
    x, m = torch.randn(2, 4, requires_grad=True), torch.rand(4, requires_grad=True)
    y = {"layer_norm": lambda: masked_layer_norm(x, m, None, None, 1e-6),
         "rms_rescale": lambda: masked_rms_rescale(norm(x), x, m, 1e-6, norm.forward),
         "rms_rescale_kept": lambda: masked_rms_rescale(norm(x), x, m, 1e-6),
         "rms_norm": lambda: masked_rms_norm(x, m, norm.weight, 1e-6),
         "weights": lambda: mask_weights(m) * x}[which]()
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(y.square().sum(), (x, m), create_graph=True)
    assert all(g is not None for g in torch.autograd.grad(y.square().sum(), (x, m), allow_unused=True)[1:])


def _rms_whole_definition(x, m, w, offset, eps):
    """The RMS norm over the kept channels written out: mask-weighted mean square."""
    xf = x.float()
    ms = (xf * xf * m).sum(-1, keepdim=True) / m.sum()
    return (w + offset) * xf * torch.rsqrt(ms + eps)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_rms_norm_matches_its_definition_forward_and_backward(offset, dtype):
    from dmscale.core.masked_norm import masked_rms_norm
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 5, 12, generator=g) * 2 + 0.3).to(dtype).requires_grad_()
    m = torch.rand(12, generator=g).requires_grad_()
    w = torch.randn(12, generator=g).requires_grad_()
    got = masked_rms_norm(x, m, w, 1e-5, offset, torch.float32)
    want = _rms_whole_definition(x, m, w, offset, 1e-5)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    gy = torch.randn(got.shape, generator=g)
    for a, b in zip(torch.autograd.grad(got, (x, m, w), gy), torch.autograd.grad(want, (x, m, w), gy)):
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_masked_rms_norm_gradcheck_in_float64_and_exact_for_any_weights():
    from dmscale.core.masked_norm import MaskedRMSNorm
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 3, 6, generator=g, dtype=torch.float64).requires_grad_()
    p = (torch.rand(6, generator=g, dtype=torch.float64) + 0.2).requires_grad_()  # sum(p) != 1
    w = torch.randn(6, generator=g, dtype=torch.float64).requires_grad_()
    for offset in (0.0, 1.0):
        assert torch.autograd.gradcheck(lambda a, b, c: MaskedRMSNorm.apply(a, b, c, 1e-3, offset, torch.float64),
                                        (x, p, w))


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_a_searched_hf_rms_norm_is_computed_whole_and_equals_the_rescaled_one(family):
    """Where the gain is ``weight`` (Llama) or ``1 + weight`` (Gemma), the search computes the
    masked norm whole (no backward through the norm's own graph, nothing recomputed): the same
    output and gradients as rescaling the norm's output, to float rounding."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from dmscale.core.mask_hooks import MaskedNorm
    from dmscale.trace.handlers.norms import norm_formula

    cls, offset = {"llama": (LlamaRMSNorm, 0.0), "gemma": (GemmaRMSNorm, 1.0)}[family]

    class Source:  # the gates a hook reads
        enabled, fuse_norms = True, False

        def __init__(self, m):
            self.m = m

        def channel_mask(self, key):
            return self.m

        def norm_weights(self, key):
            return self.m / self.m.sum()
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 5, 16, generator=g, dtype=torch.float64).requires_grad_()
    m = torch.rand(16, generator=g, dtype=torch.float64).requires_grad_()
    outs = []
    for whole in (True, False):
        norm = cls(16, eps=1e-6).double()
        with torch.no_grad():
            norm.weight.uniform_(-1.0, 1.5, generator=torch.Generator().manual_seed(10))
        formula = norm_formula(norm)
        assert formula.offset == offset
        norm.register_forward_hook(MaskedNorm(Source(m), "k", "rms", formula.eps, offset if whole else None),
                                   with_kwargs=True)
        y = norm(x)
        assert type(y.grad_fn).__name__ == ("MaskedRMSNormBackward" if whole else "MaskedRMSRescaleBackward")
        outs.append((y, *torch.autograd.grad(y.square().sum(), (x, m, norm.weight))))
    for a, b in zip(*outs):  # (the HF norms compute in float32, whole in float64)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_autocast_turns_autocast_off_inside_and_restores_it_after_an_error():
    from dmscale.core.masked_norm import no_autocast

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with no_autocast("cpu"):
            assert not torch.is_autocast_enabled("cpu")
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")
        with pytest.raises(ValueError):
            with no_autocast("cpu"):
                raise ValueError("inside")
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with no_autocast("cpu"):  # off already: stays off
        assert not torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_as_sets_autocast_for_the_block_and_drops_its_cast_cache():
    from dmscale.core.masked_norm import autocast_as

    w = torch.nn.Parameter(torch.ones(2, 2))
    with autocast_as("cpu", True, torch.bfloat16):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ w).dtype == torch.bfloat16  # the cast of w may be cached here
    assert not torch.is_autocast_enabled("cpu")
    with torch.no_grad():
        w.mul_(3.0)
    with autocast_as("cpu", True, torch.bfloat16):  # a stale cached copy of w would give 2
        assert (torch.ones(2, 2) @ w)[0, 0].item() == 6.0


def test_the_weights_gradient_of_the_layer_norm_is_exact_through_mask_weights():
    """The norms take p = m / sum(m) (computed once per mask): the LayerNorm's gradient in p
    is exact up to one number added to every channel, which mask_weights' projection removes."""
    from dmscale.core.masked_norm import MaskedLayerNorm, mask_weights
    g = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((2, 3, 6), (6,), (6,)))
    m = torch.rand(6, generator=g, dtype=torch.float64) + 0.1
    args = [t.requires_grad_() for t in (x, m, w, b)]
    assert torch.autograd.gradcheck(lambda x, m, w, b: MaskedLayerNorm.apply(x, mask_weights(m), w, b, 1e-3), args)


def test_the_mask_gradient_of_the_layer_norm_keeps_float32_precision_where_activations_have_a_large_mean():
    """Regression: dL/dp was written with x, whose mean (1e4 here) the projection onto m then
    cancelled in float32 (relative error 4.3e-3 of the mask's gradient here; 1.6e-3 with x̂)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g, dtype=torch.float64) * 0.5 + 1e4
    m = torch.rand(48, generator=g, dtype=torch.float64) + 0.1
    gy = torch.randn(64, 48, generator=g, dtype=torch.float64)

    def mask_grad(dtype: torch.dtype) -> torch.Tensor:
        mm = m.to(dtype).requires_grad_()
        y = masked_layer_norm(x.to(dtype), mm, None, None, 1e-5)
        return torch.autograd.grad(y, mm, gy.to(dtype))[0].double()
    want, got = mask_grad(torch.float64), mask_grad(torch.float32)
    assert float((got - want).norm() / want.norm()) < 2.5e-3


def test_the_weights_gradient_of_the_rms_rescale_is_exact_for_any_weights():
    from dmscale.core.masked_norm import MaskedRMSRescale
    g = torch.Generator().manual_seed(5)
    out, x = (torch.randn(2, 3, 6, generator=g, dtype=torch.float64) for _ in range(2))
    p = torch.rand(6, generator=g, dtype=torch.float64)  # not normalised
    args = [t.requires_grad_() for t in (out, x, p)]
    assert torch.autograd.gradcheck(lambda o, a, q: MaskedRMSRescale.apply(o, a, q, 1e-3), args)


@pytest.mark.parametrize("norm", ["layernorm", "rms"])
def test_a_float64_model_s_masked_norms_compute_in_float64(norm):
    """Regression: the norms' weights p = m / sum(m) came from the gates in float32, so a
    float64 model with every channel kept differed from itself by 1e-8 (now by float64
    rounding)."""
    import copy

    from torch import nn

    import dmscale as dms
    torch.manual_seed(0)
    layer = nn.LayerNorm(24) if norm == "layernorm" else nn.RMSNorm(24, eps=1e-6)
    net = nn.Sequential(nn.Linear(8, 24), layer, nn.ReLU(), nn.Linear(24, 4)).double()
    plain = copy.deepcopy(net)
    x = torch.randn(64, 8, dtype=torch.float64) * 3 + 50.0
    searcher = dms.prepare(net, x, dms.SearchConfig(resource="macs", target=0.6, verify=False))
    with torch.no_grad(), searcher.gates.use("open"):
        assert float((net(x) - plain(x)).abs().max()) < 1e-12


def _norm_cases() -> dict[str, tuple]:
    """(function of (x, m, w, b), uses w, uses b) for every masked norm and affine form."""
    from torch import nn

    from dmscale.core.masked_norm import MaskedLayerNorm, MaskedRMSNorm, MaskedRMSRescale, mask_weights

    rms = nn.RMSNorm(8, eps=1e-5)
    return {
        "layernorm": lambda x, m, w, b: MaskedLayerNorm.apply(x, mask_weights(m), w, b, 1e-5),
        "layernorm_weight_only": lambda x, m, w, b: MaskedLayerNorm.apply(x, mask_weights(m), w, None, 1e-5),
        "layernorm_bias_only": lambda x, m, w, b: MaskedLayerNorm.apply(x, mask_weights(m), None, b, 1e-5),
        "layernorm_plain": lambda x, m, w, b: MaskedLayerNorm.apply(x, mask_weights(m), None, None, 1e-5) * w,
        "rms_whole": lambda x, m, w, b: MaskedRMSNorm.apply(x, mask_weights(m), w, 1e-5, 0.0, torch.float32),
        "rms_whole_gemma": lambda x, m, w, b: MaskedRMSNorm.apply(x, mask_weights(m), w, 1e-5, 1.0, torch.float32),
        "rms_rescale": lambda x, m, w, b: MaskedRMSRescale.apply(rms(x) * w, x, mask_weights(m), 1e-5, None),
    }


@pytest.mark.parametrize("case", list(_norm_cases()))
def test_no_masked_norm_returns_a_tensor_changed_in_place(case):
    """Regression: the weight-only LayerNorm, the plain one and the whole RMS norm returned a
    tensor their forward had changed in place (``_version`` > 0); torch 2.11's torch.compile
    of such a function computed every gradient wrong (the next test)."""
    g = torch.Generator().manual_seed(0)
    x, m, w, b = torch.randn(2, 5, 8, generator=g), torch.rand(8, generator=g), torch.randn(8), torch.randn(8)
    y = _norm_cases()[case](x, m, w, b)
    assert y._version == 0


@pytest.mark.parametrize("case", list(_norm_cases()))
def test_masked_norms_under_torch_compile_give_the_eager_gradients(case):
    """``torch.compile(fullgraph=True)`` of each masked norm: the same output and gradients as
    eager (before the fix, on torch 2.11: every gradient of the four in-place cases wrong, by up to 4)."""
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(2, 5, 8, generator=g), torch.rand(8, generator=g) + 0.1, torch.randn(8, generator=g),
              torch.randn(8, generator=g)]
    fn = _norm_cases()[case]
    weights = torch.randn(2, 5, 8, generator=g)
    results = []
    torch._dynamo.reset()
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        ts = [t.clone().requires_grad_() for t in leaves]
        y = run(*ts)
        (y * weights).sum().backward()
        results.append([y.detach()] + [t.grad if t.grad is not None else torch.zeros(()) for t in ts])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", ["layer", "rms", "rescale"])
def test_masked_norms_run_on_the_meta_device(norm):
    """Shapes only, no data (a model on ``meta`` to count FLOPs or plan memory): autocast has
    no state there; before, every masked norm raised 'unsupported scalarType' reading it."""
    from dmscale.core.masked_norm import masked_rms_norm, masked_rms_rescale
    x = torch.randn(2, 3, 8, device="meta", requires_grad=True)
    m = torch.rand(8, device="meta", requires_grad=True)
    w = torch.randn(8, device="meta", requires_grad=True)
    if norm == "layer":
        y = masked_layer_norm(x, m, w, torch.zeros(8, device="meta"), 1e-5)
    elif norm == "rms":
        y = masked_rms_norm(x, m, w, 1e-5, 0.0, torch.float32)
    else:
        y = masked_rms_rescale(x * w, x, m, 1e-5)
    gx, gm = torch.autograd.grad(y.sum(), (x, m))
    assert (y.shape, y.device.type, gx.shape, gm.shape) == (x.shape, "meta", x.shape, m.shape)
