"""The baselines of bench/peers.py reach their target cost (issue 10, table 4).

Torch-Pruning (when installed) prunes a ResNet-20 to within a few % under the target MACs,
the pruned model still runs, and its weights load into the dmscale structure built from its
shapes (the form the shared finetune reads); the uniform-width solver lands at or under the
target with the largest multiplier that fits.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import peers_lib as pl  # noqa: E402
from dmscale.tasks.models import ResNetCifar  # noqa: E402

TARGET = 0.5


@functools.lru_cache(maxsize=1)
def _template() -> dict:
    return pl.template_structure(_model(), torch.randn(1, 1, 8, 8))


def _model() -> ResNetCifar:
    torch.manual_seed(0)
    return ResNetCifar(depth=8, width=4, in_channels=1).eval()


def test_uniform_solver_hits_target() -> None:
    model, x = _model(), torch.randn(1, 1, 8, 8)
    full = pl.macs(model, x)
    structure, mult = pl.uniform_structure(model, x, TARGET)
    small = pl.apply(model, structure)
    got = pl.macs(small, x) / full
    assert 0.8 * TARGET <= got <= TARGET, got  # widths of 4/8/16 move the cost in coarse steps
    assert 0.3 < mult < 0.8
    assert {w["kept"] for w in structure["width"]} <= {max(1, int(mult * n + 0.5)) for n in (4, 8, 16)}
    assert small(x).shape == (1, 10)


@pytest.mark.parametrize("importance", ["magnitude", "taylor"])
def test_torch_pruning_reaches_target(importance: str) -> None:
    pytest.importorskip("torch_pruning")
    model, x = _model(), torch.randn(1, 1, 8, 8)
    full = pl.macs(model, x)

    def batches():
        g = torch.Generator().manual_seed(1)
        while True:
            yield torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)

    r = pl.tp_prune(model.train(), x, TARGET, importance, batches(), torch.nn.functional.cross_entropy,
                    iterative_steps=50)
    frac = r["macs"] / full
    assert 0.9 * TARGET <= frac <= TARGET, frac
    pruned = r["model"].eval()
    structure = pl.structure_from_shapes(_template(), pruned)
    again = pl.apply(model, structure)
    again.load_state_dict(pruned.state_dict())
    assert pl.macs(again, x) == r["macs"]
    assert torch.allclose(again.eval()(x), pruned(x), atol=1e-6)


def test_table_reads_each_method_against_the_unpruned_ceiling() -> None:
    """Table 4's section adds the unpruned supernet (same finetune) as a reference row and
    each method's paired difference from it, once every seed has it; not before."""
    import peers

    def row(method: str, acc: float, seed: int) -> dict:
        return {"seed": seed, "method": method, "acc": acc, "macs": 10, "params": 5, "macs_frac": 0.5,
                "target": 0.5, "prune_seconds": 1.0, "finetune_seconds": 1.0, "steps": 3, "structure": "4/4",
                "multiplier": None, "pretrain_acc": 0.9, "supernet_macs": 20, "supernet_params": 9}
    accs = {"dms_p": 0.96, "tp_magnitude": 0.90, "tp_taylor": 0.94, "uniform": 0.92}
    runs = {str(s): {m: row(m, a + 0.01 * s, s) for m, a in accs.items()} for s in (0, 1, 2)}
    cache = {"settings": {"k": {"target": 0.5, "pretrain_epochs": 1, "search_epochs": 1, "finetune_epochs": 1}},
             "runs": {"k": runs}, "info": {}}
    assert not any("unpruned" in line for line in peers._section(cache, "k"))
    for s in (0, 1, 2):
        runs[str(s)]["unpruned"] = row("unpruned", 0.97 + 0.01 * s + 0.001 * s * s, s)
    text = "\n".join(peers._section(cache, "k"))
    assert "| unpruned (reference, not pruned) | 98.17" in text
    minus = next(line for line in text.splitlines() if line.startswith("Each method minus `unpruned`"))
    assert "dms_p -1.17 [" in minus and "tp_magnitude -7.17 [" in minus  # paired: the seeds' offsets cancel


def test_cache_keys_of_another_width_leave_the_width8_keys_alone() -> None:
    """``peers.py --width 4`` stores under its own keys; a width-8 setting keeps the key its
    cached rows were stored under (no width in it)."""
    import peers

    cfg = {"target": 0.5, "pretrain_epochs": 10.0, "search_epochs": 2.0, "finetune_epochs": 4.0, "settle": 0.4,
           "settle_hold": True}
    assert peers._key(cfg) == "t0.5-pre10.0-s2.0-ft4.0-settle0.4-hold"
    assert peers._key({**cfg, "width": 8}) == peers._key(cfg)
    assert peers._key({**cfg, "width": 4}) == "w4-t0.5-pre10.0-s2.0-ft4.0-settle0.4-hold"
    assert peers._model(4)["model_args"] == {"width": 4} and peers.MODEL["model_args"] == {"width": 8}
