"""The per-rank memory estimate (``dmscale.engine.memory``) against the measured peak of real
search steps on the CPU, and its arithmetic for sharded and frozen runs.

How the peak is measured on the CPU (torch 2.13): ``torch.profiler.profile(profile_memory=True)``
records a ``[memory]`` event for every allocation and free of the CPU allocator
(``prof.profiler.kineto_results.events()``, ``nbytes()`` positive for an allocation, negative
for a free). The profile covers everything from building the model to the end of the third
search step, so the running sum of the events, in time order, is the bytes torch held, and its
maximum the peak (``torch.cuda.max_memory_allocated`` has no CPU counterpart; tracemalloc does
not see torch's allocator).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dmscale as dms
from dmscale.engine.memory import MemoryEstimate, estimate_search_memory, format_bytes
from dmscale.engine.memory_trace import trace_step
from dmscale.tasks.distill import distill_loss

VOCAB = 512


def _llama(layers: int = 4) -> torch.nn.Module:
    dms.ensure_torchvision()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, attn_implementation="sdpa"))


def _loss(model: torch.nn.Module, teacher: torch.nn.Module | None, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
    if teacher is not None:
        with torch.no_grad():
            t = teacher(input_ids=ids).logits
        loss = loss + distill_loss(logits, t, 1.0)
    return loss


def _meta_llama() -> torch.nn.Module:
    """A Llama of 4 layers, hidden 256, on the meta device (shapes only)."""
    dms.ensure_torchvision()
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688,
                                            num_hidden_layers=4, num_attention_heads=4))


def _shape_loss(m: torch.nn.Module) -> torch.Tensor:
    """A loss of :func:`_meta_llama` over random ids of 2 x 64, on the model's device."""
    ids = torch.randint(0, 1000, (2, 64), device=next(m.parameters()).device)
    return m(input_ids=ids).logits.float().logsumexp(-1).mean()


def _measured_peak(batch: int, seq: int, distill: bool) -> tuple[int, dict]:
    """Peak bytes of the CPU allocator over building a tiny Llama (+ a teacher copy), preparing
    it and three search steps (AdamW on the weights, Adam on the ratios), and what was built."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    kept: dict = {}

    def run() -> None:
        model = _llama().train()
        teacher = copy.deepcopy(model).eval().requires_grad_(False) if distill else None
        searcher = dms.prepare(model, {"input_ids": ids[:1]}, dms.SearchConfig("params", 0.5))
        opt_w = torch.optim.AdamW(list(searcher.model_parameters()), lr=1e-4)
        opt_s = torch.optim.Adam(list(searcher.structure_parameters()), lr=1e-2)
        for _ in range(3):
            loss = _loss(model, teacher, ids) + searcher.resource_loss(0.5)
            opt_w.zero_grad()
            opt_s.zero_grad()
            loss.backward()
            opt_w.step()
            opt_s.step()
        kept.update(model=model, teacher=teacher)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak, kept


@pytest.mark.parametrize("batch, seq, distill", [
    (2, 32, True),
    pytest.param(8, 128, True, marks=pytest.mark.slow),  # 10-23 s each on two shared cores
    pytest.param(8, 64, False, marks=pytest.mark.slow),
])
def test_the_estimate_is_within_15_percent_of_the_measured_peak(batch, seq, distill):
    peak, built = _measured_peak(batch, seq, distill)
    model, teacher = built["model"], built["teacher"]
    est = estimate_search_memory(
        model, lambda m: _loss(m, teacher, torch.randint(0, VOCAB, (batch, seq))),
        optimizer="adamw", teacher=teacher, device="cpu")
    assert abs(est.total - peak) <= 0.15 * peak, (
        f"estimated {format_bytes(est.total)}, measured {format_bytes(peak)}\n{est.table()}")
    assert all(p.grad is not None for p in model.parameters())  # the trace left the model alone


def test_the_trace_leaves_the_model_alone_and_counts_its_gradients():
    model = _llama(layers=2)
    searcher = dms.prepare(model, {"input_ids": torch.zeros(1, 8, dtype=torch.long)}, dms.SearchConfig("params", 0.5))
    before = {n: b.clone() for n, b in model.named_buffers()}
    t = trace_step(model, lambda m: _loss(m, None, torch.randint(0, VOCAB, (2, 16))))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[n], b) and type(b) is torch.Tensor for n, b in model.named_buffers())
    assert t.grads == 4 * sum(p.numel() for p in model.parameters())  # weights and gates: float32
    assert t.peak_without_grads < t.peak and t.saved > 0
    assert not searcher.has_importance()  # no importance update reached the real gates


def test_a_meta_model_costs_nothing_and_sharding_divides_the_state():
    model = _meta_llama()
    n = sum(p.numel() for p in model.parameters())

    one = estimate_search_memory(model, _shape_loss, precision="bf16")
    eight = estimate_search_memory(model, _shape_loss, world_size=8, shard="fsdp", precision="bf16")
    assert one.weights == one.gradients == 4 * n and one.optimizer_state == 8 * n
    assert eight.weights == -(-4 * n // 8) and eight.optimizer_state == 2 * eight.gradients
    assert eight.communication > 0 and eight.total < one.total
    assert isinstance(one, MemoryEstimate) and "total (peak)" in one.table()
    ddp = estimate_search_memory(model, activations=2**20, world_size=2)
    assert ddp.communication == ddp.gradients and ddp.activations == 2**20
    frozen = estimate_search_memory(model, train_weights=False)
    assert frozen.gradients == frozen.optimizer_state == 0 and "not estimated" in frozen.table()


@pytest.mark.parametrize("kw, why", [({"shard": "zero3"}, "shard must be"), ({"precision": "8"}, "precision must"),
                                     ({"optimizer": "lion"}, "optimizer must"), ({"world_size": 0}, "world_size")])
def test_bad_arguments_say_what_was_expected(kw, why):
    with pytest.raises(ValueError, match=why):
        estimate_search_memory(torch.nn.Linear(2, 2), **kw)


def test_fsdp_bf16_gathers_bfloat16_weights_and_shards_a_bfloat16_teacher():
    model = _meta_llama()
    n = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())

    whole = estimate_search_memory(model, _shape_loss, precision="bf16", teacher=model)
    assert whole.teacher == 4 * n + buffers  # one process: the whole float32 teacher
    fp32 = estimate_search_memory(model, _shape_loss, world_size=8, shard="fsdp", precision="32", teacher=model)
    bf16 = estimate_search_memory(model, _shape_loss, world_size=8, shard="fsdp", precision="bf16", teacher=model)
    assert fp32.teacher == -(-4 * n // 8) + buffers and bf16.teacher == -(-2 * n // 8) + buffers
    assert bf16.weights == fp32.weights and bf16.communication < fp32.communication
    copies = trace_step(model, _shape_loss, torch.bfloat16).peak_without_grads  # autocast's bfloat16 copy of each weight
    gathered = trace_step(model, _shape_loss, torch.bfloat16, param_dtype=torch.bfloat16).peak_without_grads
    assert bf16.activations == gathered < copies
    assert "gathers the weights in bfloat16" in bf16.table()
    cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 8, 3))
    kept = estimate_search_memory(cnn, activations=0, world_size=2, shard="fsdp", precision="bf16", teacher=cnn)
    assert "float32 weights: it has a BatchNorm layer" in kept.table()
    assert kept.teacher == -(-4 * sum(p.numel() for p in cnn.parameters()) // 2) + \
        sum(b.numel() * b.element_size() for b in cnn.buffers())


def test_the_trace_is_the_same_every_time():
    """Storages are told apart by creation, not by address (a freed one's may be reused)."""
    model = _llama(layers=2)

    def loss(m: torch.nn.Module) -> torch.Tensor:
        return _loss(m, None, torch.randint(0, VOCAB, (4, 64)))

    runs = {(t.peak, t.peak_without_grads) for t in (trace_step(model, loss) for _ in range(3))}
    assert len(runs) == 1 and next(iter(runs))[1] <= next(iter(runs))[0]
