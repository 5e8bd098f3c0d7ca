"""NVIDIA ModelOpt FastNAS as a peer of DMS_p at equal MACs (issue 50, table 4).

FastNAS (``modelopt.torch.prune.prune(model, mode="fastnas", ...)``, the package installed by
the project's ``bench`` extra) converts a CNN into a search space, sorts every channel group
by its importance, measures each width choice's *sensitivity* (the drop of the user's
``score_func`` when that one group is narrowed, BatchNorm statistics recalibrated on the
``data_loader`` batches for every sub-net), then binary-searches one sensitivity threshold so
that the sub-net meets a ``flops`` constraint and exports it as a plain ``nn.Module``.

Two things make an equal-terms comparison with the project's peers:

* **Granularity.** ModelOpt's default rules keep channels in multiples of 32, so a width-8
  ResNet-20 has nothing to prune ("does not contain any configurable hyperparameters").
  :func:`fastnas_rules` gives the same width ratios (5 % to 100 %) with divisor 1;
  ``rules=None`` keeps ModelOpt's defaults (for models whose widths are multiples of 32).
* **Cost.** ModelOpt counts FLOPs with ``torchprofile`` (a "50 %" constraint is not 0.5 x MACs
  by :func:`dmscale.count`), so :func:`fastnas_prune` bisects the percentage constraint until
  ``dms.count`` MACs land within ``tol`` (1 %) *under* the target, like the other peers'
  "MACs under the target". The sensitivity map is measured once per call and read back from
  ModelOpt's ``checkpoint`` by every later bisection step.

Data: :func:`holdout_split` cuts the *training* split into calibration batches (ModelOpt's
``data_loader``) and a held-out scoring part (``score_func``); the test split is never read.
"""

from __future__ import annotations

import contextlib
import copy
import io
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import dmscale as dms

__all__ = ["fastnas_rules", "holdout_split", "accuracy_score", "fastnas_prune", "prune_on_task", "modelopt_version"]

Batch = tuple[torch.Tensor, torch.Tensor]


def modelopt_version() -> str:
    """The installed ``nvidia-modelopt`` version (raises ImportError when it is missing)."""
    import modelopt

    return str(modelopt.__version__)


def fastnas_rules(divisor: int = 1) -> dict[str, dict[str, Any]]:
    """FastNAS's default rules (width ratios 5 %, 10 %, ..., 100 % of every conv / linear /
    norm layer) with channels rounded to multiples of ``divisor`` instead of 32.

    Example:
        >>> fastnas_rules()["nn.Conv2d"]["channel_divisor"]
        1
    """
    ratios = tuple(round(0.05 * i, 2) for i in range(1, 21))
    conv = {"channels_ratio": ratios, "kernel_size": (), "channel_divisor": divisor}
    feat = {"features_ratio": ratios, "feature_divisor": divisor}
    return {"nn.Conv2d": conv, "nn.Linear": feat, "nn.BatchNorm2d": feat}


def holdout_split(x_train: torch.Tensor, y_train: torch.Tensor, seed: int, holdout: float = 0.2,
                  batch_size: int = 128) -> tuple[list[Batch], list[Batch]]:
    """``(calibration batches, scoring batches)``: a seeded permutation of the training split,
    its last ``holdout`` fraction for the score and the rest for BatchNorm calibration.

    Example:
        >>> x, y = torch.randn(10, 1, 2, 2), torch.arange(10)
        >>> cal, score = holdout_split(x, y, seed=0, holdout=0.2, batch_size=4)
        >>> [len(b[1]) for b in cal], [len(b[1]) for b in score]
        ([4, 4], [2])
    """
    n = len(x_train)
    k = max(1, int(round(holdout * n)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    cal_idx, score_idx = perm[:n - k], perm[n - k:]

    def batches(idx: torch.Tensor) -> list[Batch]:
        return [(x_train[idx[i:i + batch_size]], y_train[idx[i:i + batch_size]]) for i in range(0, len(idx), batch_size)]
    return batches(cal_idx), batches(score_idx)


def accuracy_score(batches: list[Batch]) -> Callable[[nn.Module], float]:
    """ModelOpt's ``score_func``: top-1 accuracy on ``batches``, ties broken by the mean
    cross-entropy (a term under half an image: ``-min(CE, 20) / (40 n)``).

    Why the tie-break: FastNAS's sub-nets are the chain of one sensitivity threshold, and plain
    accuracy on a few hundred images gives many groups the same sensitivity, so one threshold
    step narrows many groups at once and some budgets (0.25 x on a ResNet-20 of width 4: 0.228
    or 0.264 x, nothing between) cannot be met within 1 %. The score calls ``model.eval()``
    first, which makes ModelOpt recalibrate the BatchNorm statistics of the selected sub-net on
    its ``data_loader`` batches (its own hook on ``eval``).
    """
    n = sum(len(y) for _, y in batches)

    @torch.no_grad()
    def score(model: nn.Module) -> float:
        model.eval()
        hits, loss = 0, 0.0
        for x, y in batches:
            logits = model(x)
            hits += int((logits.argmax(-1) == y).sum())
            loss += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        return 100.0 * (hits / n - min(loss / n, 20.0) / (40 * n))
    return score


def _one_search(model: nn.Module, example: torch.Tensor, percent: float, rules: dict[str, Any] | None,
                config: dict[str, Any]) -> nn.Module:
    """One ``mtp.prune`` run on a copy of ``model`` under ``flops <= percent %``; the exported
    plain module (ModelOpt's progress output silenced)."""
    import modelopt.torch.prune as mtp

    work = copy.deepcopy(model)
    mode = [("fastnas", rules)] if rules is not None else "fastnas"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        pruned, _ = mtp.prune(work, mode=mode, constraints={"flops": f"{percent:.6f}%"},
                              dummy_input=example, config=dict(config))
    return pruned


def fastnas_prune(model: nn.Module, example: torch.Tensor, target: float, calibration: list[Batch],
                  scoring: list[Batch], checkpoint: Path, rules: dict[str, Any] | None = None,
                  tol: float = 0.01, max_runs: int = 24) -> dict[str, Any]:
    """FastNAS on a copy of ``model`` to within ``tol`` under ``target`` x its ``dms.count`` MACs.

    Bisects the percentage ``flops`` constraint given to ``mtp.prune`` (ModelOpt's own count)
    until the exported sub-net's MACs by :func:`dmscale.count` are in
    ``[(1 - tol) * budget, budget]``; when no constraint lands there (FastNAS's sub-nets form a
    chain ordered by its sensitivity threshold, so some budgets fall between two of them), the
    largest sub-net under the budget is returned and ``in_window`` is False.

    Args:
        model: the pretrained network (not modified).
        example: one input batch (ModelOpt's ``dummy_input``; MACs per this batch).
        target: fraction of ``model``'s MACs.
        calibration / scoring: training-split batches for BatchNorm calibration / ``score_func``.
        checkpoint: ModelOpt's search checkpoint file (removed first; holds the sensitivity map).
        rules: FastNAS rules (:func:`fastnas_rules`), ``None`` for ModelOpt's defaults.

    Returns:
        ``{"model", "macs", "percent", "runs", "in_window", "evals", "seconds", "tried"}``:
        the exported sub-net, its MACs, the constraint that produced it, the number of
        ``mtp.prune`` runs, whether it landed in the window, the number of sensitivity
        evaluations of ``score_func`` and ``[(percent, macs), ...]`` of every run.
    """
    checkpoint = Path(checkpoint)
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.unlink(missing_ok=True)
    full = int(dms.count(model, example)["macs"])
    budget = target * full
    calls = 0
    base_score = accuracy_score(scoring)

    def score(m: nn.Module) -> float:
        nonlocal calls
        calls += 1
        return base_score(m)
    config = {"data_loader": calibration, "score_func": score, "checkpoint": str(checkpoint),
              "max_iter_data_loader": len(calibration), "verbose": False}
    t0 = time.perf_counter()
    lo, hi = 0.0, 100.0  # percent: lo's result fits the budget (or nothing yet), hi's does not
    best: tuple[int, float, nn.Module] | None = None
    tried: list[tuple[float, int]] = []
    percent = 100.0 * target
    for _ in range(max_runs):
        pruned = _one_search(model, example, percent, rules, config)
        got = int(dms.count(pruned, example)["macs"])
        tried.append((round(percent, 6), got))
        if got <= budget:
            lo = percent
            if best is None or got >= best[0]:  # the largest constraint giving the largest sub-net
                best = (got, percent, pruned)
            if got >= (1 - tol) * budget:
                break
        else:
            hi = percent
        if hi - lo < 0.01:  # 0.01 % of ModelOpt's FLOPs: under one channel of any layer here
            break
        percent = 0.5 * (lo + hi)
    if best is None:
        raise RuntimeError(f"FastNAS found no sub-net under {budget:.0f} MACs (tried {tried})")
    got, percent, pruned = best
    return {"model": pruned.eval(), "macs": got, "percent": percent, "runs": len(tried),
            "in_window": got >= (1 - tol) * budget, "evals": calls, "tried": tried,
            "seconds": time.perf_counter() - t0}


def prune_on_task(task: Any, model: nn.Module, example: torch.Tensor, target: float, seed: int,
                  checkpoint: Path, divisor: int = 1) -> dict[str, Any]:
    """:func:`fastnas_prune` with calibration and scoring batches cut from ``task``'s training
    split by :func:`holdout_split` (``task.x_train`` / ``task.y_train``; nothing of the test
    split is read: ``example`` only gives the input shape), with :func:`fastnas_rules` of
    ``divisor`` (32: ModelOpt's own default rules)."""
    calibration, scoring = holdout_split(task.x_train, task.y_train, seed)
    return fastnas_prune(model, example, target, calibration, scoring, checkpoint,
                         rules=None if divisor == 32 else fastnas_rules(divisor))
