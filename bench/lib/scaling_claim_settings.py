"""The settings of the scaling-claim table (``python -m bench.scaling_claim``) and the cache keys
its runs are stored under (settings that agree on a protocol share runs), shared with the table
(``scaling_claim_table``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bench.lib import np_uniform_lib as nl

__all__ = ["Setting", "SETTINGS", "NARROW", "model_id", "baseline_key", "search_key", "dms_key", "narrow_dims"]

NARROW = 2  # a width kept at this many channels or fewer counts as narrow (narrow_dims)



@dataclass(frozen=True)
class Setting:
    """One row of the table: a baseline model and the protocol both arms run under.

    Attributes:
        name: the row's name (and the cache's).
        kind: "image" (top-1, higher is better) or "text" (test bits per character, lower).
        model: the RunConfig fields that make the baseline (task, model, model_args, limits).
        search_epochs / retrain_epochs: of the DMS search / of every from-scratch training.
        seeds: fixed before any run.
        budgets: resources capped at the baseline's own count ("macs" always first).
        min_width: the search's smallest width (x_min; 1 = the default).
        tests: what the setting measures (one line of the table's notes).
        round: 1 for the settings fixed before any DMS run; 2 for one added once round 1's
            results were in; 3 once round 2's were (the table marks it and names why in ``tests``).
    """

    name: str
    kind: str
    model: dict[str, Any]
    search_epochs: float
    retrain_epochs: float
    seeds: tuple[int, ...]
    budgets: tuple[str, ...] = ("macs",)
    min_width: int = 1
    tests: str = ""
    round: int = 1


_DIGITS = {"task": "digits", "model": "resnet"}
_TEXT = {"task": "shakespeare", "model": "charcnn", "model_args": {"width": 32, "hidden": 64, "blocks": 4},
         "train_limit": 500_000, "test_limit": 100_000}
_MNIST_W4 = {"task": "mnist", "model": "resnet", "model_args": {"width": 4}, "train_limit": 5000}
_TWENTY, _EIGHT = tuple(range(20)), tuple(range(8))
SETTINGS: tuple[Setting, ...] = (
    Setting("digits-w8", "image", {**_DIGITS, "model_args": {"width": 8}}, 10.0, 20.0, _TWENTY,
            tests="the protocol of issue table 3 (ResNet-20, width 8)"),
    Setting("digits-w4", "image", {**_DIGITS, "model_args": {"width": 4}}, 10.0, 20.0, _TWENTY,
            tests="a narrower baseline, further from the digits' ceiling"),
    Setting("digits-w4-R40", "image", {**_DIGITS, "model_args": {"width": 4}}, 10.0, 40.0, _TWENTY,
            tests="longer from-scratch training (both arms 40 epochs; the searches of digits-w4)"),
    Setting("digits-w4-S30", "image", {**_DIGITS, "model_args": {"width": 4}}, 30.0, 20.0, _TWENTY,
            tests="a 3x longer search of the 4.6x supernet"),
    Setting("digits-w4-params", "image", {**_DIGITS, "model_args": {"width": 4}}, 10.0, 20.0, _TWENTY,
            budgets=("macs", "params"), tests="the baseline's parameters as a second budget"),
    Setting("digits-w4-min3", "image", {**_DIGITS, "model_args": {"width": 4}}, 10.0, 20.0, _TWENTY,
            min_width=3, tests="no width kept at one or two channels (--min-width 3)"),
    Setting("text-charcnn-R10", "text", _TEXT, 5.0, 10.0, _EIGHT,
            tests="CharCNN (width 32, hidden 64, 4 blocks), 10 epochs of 500k characters"),
    Setting("text-charcnn-R30", "text", _TEXT, 5.0, 30.0, _EIGHT,
            tests="longer from-scratch training (both arms 30 epochs; the searches of R10)"),
    Setting("digits-w2", "image", {**_DIGITS, "model_args": {"width": 2}}, 10.0, 20.0, _TWENTY, round=2,
            tests="added once digits-w8, -w4 and -w4-R40 had tied: a baseline far below the digits' "
                  "ceiling, where issue table 3 found DMS structures ahead of one width multiplier"),
    Setting("mnist-w4", "image", _MNIST_W4,
            5.0, 10.0, tuple(range(10)), round=2,
            tests="added once every digits setting had tied: MNIST's 10,000 test images (1 image = 0.01 pt; "
                  "the digits' 359: 0.28 pt), the first 5,000 training images, the protocol of np_uniform_mnist"),
    Setting("mnist-w4-rep", "image", _MNIST_W4,
            5.0, 10.0, tuple(range(10, 20)), round=3,
            tests="added once mnist-w4 had won (round 2): the same protocol on ten fresh seeds (10-19), "
                  "a replication of a result found after the fact"),
    Setting("mnist-w4-params", "image", _MNIST_W4,
            5.0, 10.0, tuple(range(20)), budgets=("macs", "params"), round=3,
            tests="added once mnist-w4 had won with 1.26-1.60x the baseline's parameters: the baseline's "
                  "parameters as a second budget, so that the win cannot come from parameters"),
)


def _quick(settings: tuple[Setting, ...]) -> tuple[Setting, ...]:
    """The smoke run's settings: the first image and text settings, one seed, half an epoch,
    and 20k training / 10k test characters."""
    image = next(s for s in settings if s.kind == "image")
    text = next(s for s in settings if s.kind == "text")
    small = {**text.model, "train_limit": 20_000, "test_limit": 10_000}
    return (dataclasses.replace(image, seeds=(0,), search_epochs=0.5, retrain_epochs=0.5),
            dataclasses.replace(text, model=small, seeds=(0,), search_epochs=0.5, retrain_epochs=0.5))


def model_id(s: Setting) -> str:
    """The baseline model and its data, as a cache-key part (settings that share it share runs).

        >>> model_id(SETTINGS[0])
        'digits/resnet/width=8'
        >>> model_id(next(s for s in SETTINGS if s.kind == "text"))
        'shakespeare/charcnn/blocks=4,hidden=64,width=32/test_limit=100000,train_limit=500000'
    """
    m = s.model
    args = ",".join(f"{k}={v}" for k, v in sorted((m.get("model_args") or {}).items()))
    data = ",".join(f"{k}={m[k]}" for k in sorted(m) if k not in ("task", "model", "model_args") and m[k] is not None)
    return "/".join(p for p in (m["task"], m["model"], args, data) if p)


def _budget_id(s: Setting) -> str:
    return "+".join(s.budgets) + (f"/min{s.min_width}" if s.min_width > 1 else "")


def baseline_key(s: Setting, seed: int) -> str:
    """Cache key of the baseline's run: model, retrain length and seed.

        >>> baseline_key(SETTINGS[2], 3)
        'baseline/digits/resnet/width=4/R40.0/s3'
    """
    return f"baseline/{model_id(s)}/R{s.retrain_epochs}/s{seed}"


def search_key(s: Setting, seed: int) -> str:
    """Cache key of one DMS_np search from ``--expand``: model, search length, budgets, seed.

        >>> search_key(SETTINGS[4], 0), search_key(SETTINGS[5], 0)
        ('search/digits/resnet/width=4/S10.0/macs+params/s0', 'search/digits/resnet/width=4/S10.0/macs/min3/s0')
    """
    return f"search/{model_id(s)}/S{s.search_epochs}/{_budget_id(s)}/s{seed}"


def dms_key(s: Setting, seed: int) -> str:
    """Cache key of a search's structure trained from scratch (the search's key and the
    retrain length).

        >>> dms_key(SETTINGS[1], 7)
        'dms_expand/digits/resnet/width=4/S10.0/macs/R20.0/s7'
    """
    return f"dms_expand/{model_id(s)}/S{s.search_epochs}/{_budget_id(s)}/R{s.retrain_epochs}/s{seed}"


def narrow_dims(structure: dict[str, Any], at_most: int = NARROW) -> int:
    """How many width dims of the export keep ``at_most`` channels or fewer (dims whose every
    producer sits in a removed block do not exist in the export and are not counted).

        >>> narrow_dims({"width": [{"size": 6, "kept": 2, "producers": ["b.0.c"]},
        ...                        {"size": 6, "kept": 1, "producers": ["b.1.c"]},
        ...                        {"size": 6, "kept": 5, "producers": ["b.2.c"]}],
        ...              "depth": [], "removed_blocks": [{"name": "b.1"}]})
        1
    """
    fractions = nl.effective_kept(structure)
    return sum(1 for w, f in zip(structure.get("width", []), fractions) if f > 0 and w["kept"] <= at_most)
