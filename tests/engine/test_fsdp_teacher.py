"""A sharded distillation teacher (``dmscale.engine.fsdp.shard_frozen``) and bfloat16-gathered
weights (``shard_model(param_dtype=torch.bfloat16)``) on two CPU ranks (gloo,
``fsdp_teacher_worker``): the teacher's logits are the whole teacher's, a distilled search
with it is the search with the whole teacher, and the search with bfloat16-gathered weights
finds the structure of the float32-weight search under the same autocast.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_teacher_worker
from dmscale.core.errors import ConfigError
from dmscale.engine import fsdp
from dmscale.engine.fsdp import shard_frozen, sharded
from dmscale.engine.fsdp_plan import low_precision_params_unsupported, mixed_precision
from spawn_ranks import spawn_ranks

WORLD, DEADLINE_S = 2, 300.0


# ---------------------------------------------------------------------- one process
def test_one_process_shards_no_teacher():
    net = fsdp_teacher_worker.teacher()
    handle = shard_frozen(net, param_dtype=torch.bfloat16)
    assert not handle.active and sharded(net) is None
    assert {p.dtype for p in net.parameters()} == {torch.float32}  # nothing stored in bfloat16 either


def test_a_teacher_that_trains_is_refused(monkeypatch):
    monkeypatch.setattr(fsdp, "is_distributed", lambda group=None: True)
    with pytest.raises(ConfigError, match=r"expected a frozen module, but '0.weight'.*requires_grad_\(False\)"):
        shard_frozen(nn.Sequential(nn.Linear(2, 2)))


def test_batchnorm_models_keep_float32_weights():
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    assert "BatchNorm layer ('1')" in low_precision_params_unsupported(cnn)
    assert mixed_precision(cnn, torch.bfloat16) is None
    llama_like = nn.Sequential(nn.Embedding(8, 4), nn.LayerNorm(4), nn.Linear(4, 8))
    assert low_precision_params_unsupported(llama_like) is None
    policy = mixed_precision(llama_like, torch.bfloat16)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision(llama_like, None) is None and mixed_precision(llama_like, torch.float32) is None


# ---------------------------------------------------------------------- two ranks, gloo
def _spawn(tmp_path_factory, cases: tuple[str, ...]) -> list[dict]:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    out = tmp_path_factory.mktemp("fsdp_teacher")
    return spawn_ranks(fsdp_teacher_worker.worker, WORLD, out, cases, deadline_s=DEADLINE_S)


@pytest.fixture(scope="module")
def teacher_ranks(tmp_path_factory):
    return _spawn(tmp_path_factory, ("teacher_logits", "whole_teacher", "sharded_teacher"))


@pytest.fixture(scope="module")
def bf16_ranks(tmp_path_factory):
    return _spawn(tmp_path_factory, ("bf16_fp32_params", "bf16_params"))


def test_the_sharded_teacher_holds_half_and_computes_the_whole_teachers_logits(teacher_ranks):
    for r in teacher_ranks:
        fp32, bf16 = r["teacher_logits"]["fp32"], r["teacher_logits"]["bf16"]
        assert fp32["active"] and fp32["param_dtype"] is None and fp32["dtypes"] == ["torch.float32"]
        assert 2 * fp32["local"] == fp32["total"]  # 1/2 of every weight on each rank
        assert torch.equal(fp32["sharded"], fp32["whole"])  # bit for bit
        # --precision bf16: stored in bfloat16, the logits of the whole teacher stored so
        assert bf16["param_dtype"] == torch.bfloat16 and bf16["dtypes"] == ["torch.bfloat16"]
        assert torch.equal(bf16["sharded"], bf16["whole"])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_a_search_distilled_from_the_sharded_teacher_is_the_search_with_the_whole_one(teacher_ranks):
    r0, r1 = teacher_ranks
    got, ref = r0["sharded_teacher"], r0["whole_teacher"]
    assert torch.equal(got["a"], r1["sharded_teacher"]["a"])  # every rank agrees
    assert got["width"] == ref["width"] and got["depth"] == ref["depth"]
    torch.testing.assert_close(got["a"], ref["a"], rtol=1e-6, atol=1e-7)
    for a, b in zip(got["importance"], ref["importance"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
    for k, v in ref["state"].items():
        torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6)


def test_bf16_gathered_weights_find_the_structure_of_float32_weights(bf16_ranks, teacher_ranks):
    """Under bf16 autocast, weights gathered in bfloat16 (no autocast copy of each) and weights
    gathered in float32 (autocast casts them): the same structure on a fixed seed, and ``a``
    and importance closer to each other than either is to the float32 search (the shards,
    gradients and gates stay float32; the mask's gradient is a bfloat16 product either way)."""
    r0, r1 = bf16_ranks
    got, ref, fp32 = r0["bf16_params"], r0["bf16_fp32_params"], teacher_ranks[0]["sharded_teacher"]
    assert got["param_dtype"] == torch.bfloat16 and ref["param_dtype"] is None
    assert torch.equal(got["a"], r1["bf16_params"]["a"])
    assert got["width"] == ref["width"] == fp32["width"] and got["depth"] == ref["depth"] == fp32["depth"]
    assert _rel(got["a"], ref["a"]) < _rel(ref["a"], fp32["a"]) and float((got["a"] - ref["a"]).abs().max()) < 1e-3
    mp_vs_autocast = sum(_rel(a, b) for a, b in zip(got["importance"], ref["importance"]))
    autocast_vs_fp32 = sum(_rel(a, b) for a, b in zip(ref["importance"], fp32["importance"]))
    assert mp_vs_autocast < autocast_vs_fp32
    assert all(v.dtype == torch.float32 for v in got["state"].values() if v.is_floating_point())
