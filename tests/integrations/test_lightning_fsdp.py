"""DMSCallback under sharding: Lightning's ModelParallelStrategy (FSDP2, the network sharded by
dmscale's shard_model in configure_model) on two gloo ranks against one process on the same
global batch, and the refusals of FSDPStrategy (FSDP1), DeepSpeedStrategy and unsupported
ModelParallelStrategy set-ups."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import dmscale as dms

dms.ensure_torchvision()
pytest.importorskip("lightning")

from dmscale.core.errors import ConfigError  # noqa: E402
from dmscale.integrations._sharding import check_strategy  # noqa: E402


def _searcher():
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return dms.prepare(net, torch.randn(2, 8), dms.SearchConfig("params", 0.5))


def _named(name: str, **attrs):
    return type(name, (), attrs)()


def test_fsdp1_and_deepspeed_strategies_are_refused_saying_why():
    searcher = _searcher()
    with pytest.raises(ConfigError, match=r"FSDP1 \(Lightning's FSDPStrategy\).*FlatParameter.*"
                                          r"Expected FSDP2, got FSDP1.*ModelParallelStrategy\(data_parallel_size=N, "
                                          r"tensor_parallel_size=1\).*shard_model"):
        check_strategy(_named("FSDPStrategy"), searcher)
    with pytest.raises(ConfigError, match=r"DeepSpeed \(Lightning's DeepSpeedStrategy\).*outside the engine.*"
                                          r"ZeRO-3.*empty placeholder.*Expected DDP or FSDP2.*ModelParallelStrategy"):
        check_strategy(_named("DeepSpeedStrategy"), searcher)
    check_strategy(_named("DDPStrategy"), searcher)  # passes


def test_model_parallel_strategy_needs_dmscale_sharding_and_no_tensor_parallelism():
    searcher = _searcher()

    class Mesh(dict):
        mesh_dim_names = ("data_parallel", "tensor_parallel")

    def mesh(dp: int, tp: int) -> Mesh:
        return Mesh(data_parallel=SimpleNamespace(size=lambda: dp), tensor_parallel=SimpleNamespace(size=lambda: tp))

    with pytest.raises(ConfigError, match=r"tensor parallelism.*expected tensor_parallel_size=1.*got 2.*\"auto\""):
        check_strategy(_named("ModelParallelStrategy", device_mesh=mesh(1, 2), world_size=2), searcher)
    with pytest.raises(ConfigError, match=r"not sharded by dmscale; expected dmscale.engine.fsdp.shard_model"):
        check_strategy(_named("ModelParallelStrategy", device_mesh=mesh(2, 1), world_size=2), searcher)
    check_strategy(_named("ModelParallelStrategy", device_mesh=mesh(1, 1), world_size=1), searcher)  # one process


@pytest.mark.filterwarnings("ignore:the structural parameters are stepped by SGD")
def test_callback_under_model_parallel_fsdp2_on_two_gloo_ranks(tmp_path):
    """Two ranks, depth searched and frozen half-way (the freezing step's local gradient of depth's
    ``a`` is averaged too): the same ratios, importance and structure on both ranks, equal to one
    process on the same global batch; rank 0 alone exports, with one process's weights. About 12 s
    on 2 cores (Lightning imports faster than transformers), so it runs by default."""
    from safetensors.torch import load_file

    from lightning_fsdp_script import main
    from test_hf_trainer import run_torchrun

    rc, err = run_torchrun("lightning_fsdp_script.py", str(tmp_path))
    assert rc == 0, err[-3000:]
    ranks = [json.loads((tmp_path / f"2-rank{r}.json").read_text()) for r in (0, 1)]
    one = main(str(tmp_path), devices=1)
    assert [r["sharded"] for r in ranks] == [True, True] and not one["sharded"]
    assert ranks[0]["depth_frozen"] and one["depth_frozen"]
    for key in ("a", "importance", "structure", "resource_losses"):
        assert ranks[0][key] == ranks[1][key], key
    assert ranks[0]["structure"] == one["structure"]
    for key, tol in (("a", 1e-7), ("importance", 1e-11), ("resource_losses", 1e-6)):
        assert torch.allclose(torch.tensor(ranks[0][key]), torch.tensor(one[key]), rtol=1e-5, atol=tol), key
    assert [r["found"] for r in ranks] == [True, False]
    weights, reference = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("found-2", "found-1"))
    assert weights.keys() == reference.keys()
    for name, w in weights.items():
        assert w.shape == reference[name].shape and torch.allclose(w, reference[name], atol=1e-6), name
