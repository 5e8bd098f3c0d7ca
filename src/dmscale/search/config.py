"""The search configuration: what to search and under which budget (:class:`SearchConfig`).

Every option of ``dmscale search`` that sets a field here is declared on that field
(:func:`dmscale.core.options.option`: its help, converter and default on the command line);
the command's parser, ``--config`` keys, ``config.yaml`` and resume are built from them.

Example:
    >>> cfg = SearchConfig(resource="params", target=0.25)
    >>> cfg.budgets
    {'params': 0.25}
    >>> SearchConfig(target=-1)
    Traceback (most recent call last):
    ...
    dmscale.core.errors.ConfigError: target must be a finite number > 0, got -1: pass a fraction of the supernet's cost (e.g. 0.5) or an absolute count > 1
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dmscale.core.errors import ConfigError
from dmscale.core.importance import IMPORTANCE_METRICS
from dmscale.cost.resources import RESOURCES
from dmscale.core.options import option
from dmscale.core.topk import GateFactory
from dmscale.core.values import (align_value, auto_or, band, boolean, budget_targets, choice, fraction,
                                 nonneg_float, open_fraction, positive_int, str_list, unit_fraction)

__all__ = ["SearchConfig", "COST_FORWARD", "DEPTH_UNITS", "BEFORE_OPTION", "CUDA_ALIGN", "resolve_align"]

COST_FORWARD = ("soft", "exact")
DEPTH_UNITS = ("block", "sublayer")
# Options whose default changed what is searched when they were added: the value that
# reproduces a state (or run) saved before the option existed.
BEFORE_OPTION: dict[str, Any] = {"settle": 0.0, "settle_hold": False, "align": 1}
# the width multiple of ``align=None`` on a CUDA device: bf16/fp16 tensor-core tiles
CUDA_ALIGN = 8


def _search(*, group: str = "search", inspect: bool = False, **kw: Any) -> dict[str, Any]:
    """The metadata of a field that is also an option of ``dmscale search``
    (:func:`dmscale.core.options.option`): the command's parser, ``--config`` keys,
    ``config.yaml`` and resume are built from it. ``inspect``: ``dmscale inspect`` takes it
    too (it decides the search space that command shows)."""
    return option(commands=("search", "inspect") if inspect else ("search",), group=group, **kw)


@dataclass
class SearchConfig:
    """What to search and under which budget.

    Attributes:
        resource: "macs", "params", "latency" or "kv_cache" (bytes of K and V cached per
            token per sequence, summed over the attention layers: :mod:`dmscale.cost.kv_cache`).
        target: <= 1: a fraction of the supernet's cost; > 1: an absolute count.
        targets: several budgets at once, ``{resource: target}`` (e.g. ``{"params": 0.7,
            "kv_cache": 0.5}``), each target as ``target``; None (default): the one budget
            ``resource`` = ``target``. Each budget has its own resource loss term (its own r_t
            schedule and settle weight), summed; the settle phase and the budget solver meet
            every one. With ``targets``, ``resource`` and ``target`` become the first budget's
            (the primary one, which single-resource reports show); leave them at their
            defaults. :attr:`budgets` is the dict either way.
        resource_weight: lambda_resource of Eq. 5.
        schedule: "exp" (r_t decays from the supernet's cost to the target, Eq. 10) or
            "constant" (r_t = target from the start).
        schedule_end: the fraction of the search, in (0, 1], over which the "exp" schedule
            decays r_t; from there on r_t holds at the final target. 1.0 (default) is Eq. 10
            as written (the target is reached only at the last step); 0.6 decays over the
            first 60 % and leaves the last 40 % to settle on the target.
        importance: "taylor" (Eq. 4), "snip", "fisher" or "index".
        normalize: rank-normalise importance (Eq. 2); False is the paper's ablation.
        width_temperature / depth_temperature: lambda = temperature * N (1 and 4, A.1.1).
        min_width: smallest width a dimension may keep (x_min, A.1.1).
        width_step: channels per unit in a coarse search space (1 = fine-grained).
        align: hardware-aligned widths: every searched width (channels, FFN units, per-head
            dims ``<attn>.head_dim``) is kept at a multiple of ``align`` (GPU tensor cores
            run multiples of 8 far faster than odd widths). A dim is then searched in units of
            ``lcm(width_step, align)`` elements and keeps at least one unit. Head counts
            (``<attn>.heads``) and blocks are counts and stay one at a time. A dim whose size
            is not a multiple of ``align`` cannot be kept aligned (its full size is not) and
            is searched as without ``align`` (in units of ``width_step``);
            :attr:`Searcher.unaligned` lists such dims. None (default, "auto"): 8 when the
            model's parameters are on a CUDA device at :func:`~dmscale.prepare`, else 1
            (:func:`resolve_align`; the resolved value is :attr:`Searcher.align`). 1 = off.
        dim_overrides: per width-dimension name, {"min": int, "step": int}; with ``align``,
            the step of an aligned dim must be a multiple of it (checked at ``prepare``).
        search_width: search widths.
        search_depth: True: every residual stage found; False: none; a list: those stages.
        exclude: module names (or prefixes) whose widths stay fixed.
        keep_depth: module names whose depth unit the search never removes (the block that
            holds each, or with ``depth_unit="sublayer"`` the branch: ``"model.layers.0.self_attn"``
            keeps the first layer's attention); their widths are still searched. A GGUF export
            needs the first layer's attention (``dmscale.save_gguf``); ``--export gguf`` pins it.
        width_only_from: progress from which depth is frozen at its hard value and only
            widths are searched (the extra width-only phase of A.1.2); None = never.
        latency_options: keyword arguments of :class:`dmscale.cost.latency.LatencyCostModel`
            (ratios, budget_s, quantile, calibrate, profile: a saved profile, e.g. measured
            on the target device). Latency is in microseconds: a target > 1 is in us.
        settle: the last fraction of the search, in [0, 1), that lands the structure on the
            budget (0 = off: the paper's loss to the last step). The exp schedule then decays
            r_t over the first ``min(schedule_end, 1 - settle)`` of the search; in the settle
            phase r_t is the final target, r_c is the exact cost of the hard masks with the
            soft cost's gradient, and the loss is two-sided around ``budget_band`` (zero
            inside, log of the distance outside, with a weight that grows while the cost is
            over the band: :mod:`dmscale.search.settle`); once the exact cost has reached the target,
            depth is frozen at its hard value (the width-only phase of A.1.2) and
            :meth:`Searcher.structure_lr_scale` anneals the structural learning rate to 0
            (cosine) over the rest of the search. Default 0.4, as the official code's
            ``decay_ratio = 0.6``: the loss alone then ends inside ``budget_band``, where Eq. 10
            to the last step ends wherever the last steps leave it.
        settle_hold: in the settle phase, once landed, the structural learning rate is 0
            while the exact cost is inside ``budget_band`` (:meth:`Searcher.structure_lr_scale`):
            the ratios move only while the cost is outside the band, so a structure that
            entered the band stays there (the cost follows the kept counts), where with the
            anneal alone the ratios kept drifting (the task loss's pull, Adam's momentum) and
            could leave it one channel at a time. Default True; with False the anneal alone
            keeps trading width between layers a little longer.
        budget_band: (low, high) fractions of the target between which the settle phase's
            loss is zero; 0 < low <= high <= 1. Default (0.98, 1.0): over the target it is
            Eq. 6's hinge on the exact cost, under 0.98 x it pulls the cost back up.
        cost_forward: the value of r_c in the resource loss (Eq. 6) before the settle phase.
            "soft": the cost of the soft masks, as the paper writes it; it sits below the exported model's cost while
            the least important kept elements have soft masks under 1, so a search that meets
            its target in soft terms exports a model over it. "exact": the exact cost of the
            hard masks (what the export will cost), with the soft cost's gradient
            (straight-through: r_c = s + (h - s).detach()).
        layer_uniform: the dims of one kind in repeated layers (every layer's FFN width, every
            layer's heads) share one pruning ratio, so all layers keep the same count while
            each keeps its own most important elements (:mod:`dmscale.search.uniform`); the result
            has a standard config (``dmscale.save_pretrained`` without custom code).
        depth_unit: what one depth element removes. "block" (default): a whole residual
            block; a transformer block's attention and FFN share its one mask. "sublayer":
            every block that chains two or more residual branches (``x1 = x + attn(x); y =
            x1 + mlp(x1)``) gets one mask per branch, so the search may drop the attention of
            one layer and the FFN of another (Puzzle's attention-free and FFN-free layers);
            a layer whose branches are all removed is removed whole. A stage keeps at least
            ``min_keep`` branches. Not with ``resource="latency"`` (its profile times whole
            blocks), nor with ``layer_uniform`` on a Hugging Face model (a standard config has
            no layer without attention or FFN).
        gate_factory: builds the gate of every width and depth dimension (None: DMS's
            :class:`~dmscale.core.topk.DifferentiableTopK`). For baselines and ablations: any
            callable with DifferentiableTopK's signature returning a
            :class:`~dmscale.core.topk.StructuralGate` (e.g. the paper's baselines MES, SNS and
            GET). Export, exact cost and the export check are the same for every gate.
        verify: self-checks on the example inputs (one extra forward each, tolerance in
            :mod:`dmscale.export.verify`): ``prepare`` refuses a model whose output changes with all
            masks open, ``export`` raises when the export does not compute what the hardened
            supernet computes. Both name the first layer that diverges.
        fold_masks: multiply the masks of convolution and linear layers into their weights
            instead of their input activations where that is the same function (the same
            output, mask gradient and importance; far less memory and work on a GPU,
            :mod:`dmscale.core.weight_masks`). False: every mask on the activations, as the paper
            writes it. Does not change what is searched (a resume may switch it).
        fuse_norms: run the masked LayerNorms and RMS rescales of the search under
            ``torch.compile`` (a few fused kernels each instead of ~40 operators,
            :mod:`dmscale.core.fused_norms`). None (default, "auto"): on a CUDA device, not on
            a CPU (compiling costs more there than it saves); a compiler failure warns once and
            runs them eagerly. Same results up to float rounding; a resume may switch it.

    ``min_width`` and ``width_step`` apply to channels; attention heads and blocks are
    always searched one at a time (``dim_overrides`` can still set a heads dim's step/min).

    Example (every searched width a multiple of 8, in units of 16 channels):
        >>> SearchConfig(align=8, width_step=16).align
        8
        >>> SearchConfig(align=0)
        Traceback (most recent call last):
        ...
        dmscale.core.errors.ConfigError: align must be None (auto: 8 on a CUDA device, 1 elsewhere) or an integer >= 1 (every searched width a multiple of it, e.g. 8), got 0
    """

    resource: str = field(default="macs", metadata=_search(
        inspect=True, convert=choice(*RESOURCES),
        help="the budgeted resource: kv_cache is the bytes of K and V cached per token per sequence "
             "(the sum over attention layers of 2 x KV heads x head dim x dtype size)"))
    target: float = field(default=0.5, metadata=_search(
        inspect=True, convert=budget_targets(RESOURCES), metavar="T",
        help="the budget: <= 1 is a fraction of the supernet's cost, > 1 an absolute count; several "
             "budgets at once as RESOURCE=T,RESOURCE=T (e.g. params=0.7,kv_cache=0.5; --resource is "
             "then the first of them), each met by the search, the settle phase and the budget solver"))
    resource_weight: float = field(default=1.0, metadata=_search(
        convert=auto_or(nonneg_float), cli_default="auto", metavar="W|auto",
        help="lambda_resource: weight of the resource loss log(r_c / r_t). auto: 50 for a search of "
             "pipeline p / p- from a pretrained --model hf:PATH (its task loss holds the structure "
             "against a weaker one in a short search), 3 for --task detect, else 1"))
    schedule: str = field(default="exp", metadata=_search(
        convert=choice("exp", "constant"),
        help="target schedule: exp decays r_t from the supernet's cost to the target over the "
             "search; constant uses the target from the start"))
    schedule_end: float = field(default=1.0, metadata=_search(
        convert=open_fraction, metavar="F",
        help="fraction of the search, in (0, 1], over which the exp schedule decays r_t; after it "
             "r_t holds at the target (1 = the whole search, Eq. 10 as written)"))
    importance: str = field(default="taylor", metadata=_search(
        convert=choice("taylor", "snip", "fisher", "index"),
        help="element importance: taylor (moving average of (m g)^2), snip, fisher, index"))
    normalize: bool = True
    width_temperature: float = 1.0
    depth_temperature: float = 4.0
    min_width: int = field(default=1, metadata=_search(
        inspect=True, convert=positive_int, metavar="N", help="the smallest width any dimension may keep"))
    width_step: int = field(default=1, metadata=_search(
        inspect=True, convert=positive_int, metavar="N",
        help="channels per search unit (a coarse search space; 1 = every channel)"))
    align: int | None = field(default=None, metadata=_search(
        inspect=True, convert=align_value, metavar="N|auto",
        help="hardware-aligned widths: keep every searched width (channels, FFN units, per-head "
             "dims) a multiple of N, searched in units of lcm(--width-step, N); head counts and "
             "blocks are counts and stay free; a width whose size is not a multiple of N is "
             "searched unaligned and named in the summary. auto (default): 8 when the search runs "
             "on CUDA (tensor-core tiles), 1 (off) on CPU"))
    dim_overrides: dict[str, dict[str, int]] = field(default_factory=dict)
    search_width: bool = True
    search_depth: bool | list[str] = True
    exclude: list[str] = field(default_factory=list, metadata=_search(
        inspect=True, cli_default=None, convert=str_list, metavar="PATTERN", flag_kind="append",
        help="module names or glob patterns (e.g. 'model.layers.*.mlp') whose widths stay fixed; "
             "comma-separated or repeated"))
    width_only_from: float | None = field(default=None, metadata=_search(
        convert=fraction, metavar="P",
        help="from this fraction of the search on, freeze depth and search widths only"))
    latency_options: dict[str, Any] = field(default_factory=dict)
    cost_forward: str = field(default="soft", metadata=_search(
        convert=choice(*COST_FORWARD),
        help="the value of r_c in the resource loss: soft (the soft masks' cost, Eq. 6) or exact "
             "(the hard masks' cost, i.e. the export's, with the soft cost's gradient)"))
    settle: float = field(default=0.4, metadata=_search(
        convert=unit_fraction, metavar="F",
        help="last fraction of the search, in [0, 1), that lands on the budget: r_t held at the "
             "target and a two-sided loss keeping the exact cost in the --budget-band; once there, "
             "depth is frozen and the structure lr anneals to 0 (0 = the paper's loss to the end)"))
    settle_hold: bool = field(default=True, metadata=_search(
        convert=boolean, metavar="BOOL",
        help="in the settle phase, once landed, hold the structure (structure lr 0) while the exact "
             "cost is inside the --budget-band, so it ends in the band once it entered it (off: the "
             "anneal alone, as before this option)"))
    budget_band: tuple[float, float] = field(default=(0.98, 1.0), metadata=_search(
        convert=band, metavar="LOW,HIGH",
        help="LOW,HIGH: fractions of the target the settle phase lands the exact cost between, and "
             "under LOW the budget solver gives a found model its unused budget back (a wider band, "
             "e.g. 0.95,1.0, lands coarse search spaces whose steps jump over 2 %%)"))
    verify: bool = True
    layer_uniform: bool = field(default=False, metadata=_search(
        inspect=True, convert=boolean, flag_kind="flag",
        help="every repeated layer keeps the same count per kind (heads, FFN width, ...), each its "
             "own most important elements; a Hugging Face model then exports with a standard config "
             "(export --format hf loads with plain from_pretrained)"))
    gate_factory: GateFactory | None = None
    fold_masks: bool = True
    fuse_norms: bool | None = field(default=None, metadata=_search(
        convert=auto_or(boolean), group="run", metavar="BOOL|auto",
        help="run the search's masked LayerNorms / RMS norms under torch.compile (a few fused kernels "
             "each instead of ~40 operators; same results up to float rounding). auto (default): on "
             "CUDA, not on CPU; a compiler failure warns once and runs them eagerly"))
    depth_unit: str = field(default="block", metadata=_search(
        inspect=True, convert=choice(*DEPTH_UNITS),
        help="what one depth element removes: a whole residual block (block), or each residual "
             "branch of a block apart (sublayer: the search may drop the attention of one layer and "
             "the FFN of another; a Hugging Face export then needs the per-layer format, not "
             "--layer-uniform)"))
    targets: dict[str, float] | None = None
    keep_depth: list[str] = field(default_factory=list, metadata=_search(
        inspect=True, cli_default=None, convert=str_list, metavar="MODULE", flag_kind="append",
        help="module names or glob patterns whose depth unit the search never removes (the block "
             "that holds each; with --depth-unit sublayer the branch, e.g. "
             "'lm.model.layers.0.self_attn'); their widths are still searched; comma-separated or "
             "repeated"))
    keep_width: list[str] = field(default_factory=list, metadata=_search(
        inspect=True, cli_default=None, convert=str_list, metavar="MODULE", flag_kind="append",
        help="width dims the search never narrows: a layer writing the dim (name or glob, e.g. "
             "'layer3.0.conv2'), or 'residual': every width that two or more blocks write (a "
             "residual stream); comma-separated or repeated"))

    @property
    def budgets(self) -> dict[str, float]:
        """``{resource: target}`` of every budget: ``targets``, or ``{resource: target}``.

            >>> SearchConfig("params", 0.3).budgets
            {'params': 0.3}
            >>> SearchConfig(targets={"params": 0.7, "kv_cache": 0.5}).budgets
            {'params': 0.7, 'kv_cache': 0.5}
        """
        return dict(self.targets) if self.targets is not None else {self.resource: self.target}

    def _check_targets(self) -> None:
        """Validate ``targets`` and make ``resource`` / ``target`` its first budget."""
        if self.targets is None:
            return
        if not isinstance(self.targets, dict) or not self.targets:
            raise ConfigError(f"targets must be a non-empty dict {{resource: target}} (e.g. "
                              f"{{'params': 0.7, 'kv_cache': 0.5}}), got {self.targets!r}")
        for res, value in self.targets.items():
            if res not in RESOURCES:
                raise ConfigError(f"targets: unknown resource {res!r}: expected one of {RESOURCES}")
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0
                                               and math.isfinite(value)):
                raise ConfigError(f"targets[{res!r}] must be a finite number > 0, got {value!r}: pass a "
                                  "fraction of the supernet's cost (e.g. 0.5) or an absolute count > 1")
        first = next(iter(self.targets.items()))
        if (self.resource, self.target) not in (("macs", 0.5), first):
            raise ConfigError(f"pass either resource={self.resource!r}, target={self.target!r} (one "
                              f"budget) or targets={self.targets!r} (several), not both")
        self.targets = {str(k): float(v) for k, v in self.targets.items()}
        self.resource, self.target = first[0], float(first[1])

    def __post_init__(self) -> None:
        self._check_targets()
        if self.resource not in RESOURCES:
            raise ConfigError(f"unknown resource {self.resource!r}: expected one of {RESOURCES}")
        if not (isinstance(self.target, (int, float)) and self.target > 0 and math.isfinite(self.target)):
            raise ConfigError(f"target must be a finite number > 0, got {self.target!r}: pass a fraction "
                              "of the supernet's cost (e.g. 0.5) or an absolute count > 1")
        if self.resource_weight < 0:
            raise ConfigError(f"resource_weight must be >= 0, got {self.resource_weight}")
        if self.schedule not in ("exp", "constant"):
            raise ConfigError(f"schedule must be 'exp' or 'constant', got {self.schedule!r}")
        if not (isinstance(self.schedule_end, (int, float)) and not isinstance(self.schedule_end, bool)
                and 0 < self.schedule_end <= 1):
            raise ConfigError(f"schedule_end must be in (0, 1] (the fraction of the search over which "
                              f"r_t decays; 1 = the whole search, Eq. 10), got {self.schedule_end!r}")
        if not (isinstance(self.settle, (int, float)) and not isinstance(self.settle, bool)
                and 0 <= self.settle < 1):
            raise ConfigError(f"settle must be in [0, 1) (the last fraction of the search that lands on "
                              f"the budget; 0 = off), got {self.settle!r}")
        if not isinstance(self.settle_hold, bool):
            raise ConfigError(f"settle_hold must be True or False, got {self.settle_hold!r}")
        band = tuple(self.budget_band) if isinstance(self.budget_band, (list, tuple)) else ()
        if len(band) != 2 or not all(isinstance(b, (int, float)) for b in band) \
                or not 0 < band[0] <= band[1] <= 1:
            raise ConfigError(f"budget_band must be (low, high) with 0 < low <= high <= 1 (fractions of "
                              f"the target the settle phase aims between), got {self.budget_band!r}")
        self.budget_band = (float(band[0]), float(band[1]))
        if self.importance not in IMPORTANCE_METRICS:
            raise ConfigError(f"unknown importance {self.importance!r}: expected one of {sorted(IMPORTANCE_METRICS)}")
        if self.min_width < 1:
            raise ConfigError(f"min_width must be >= 1, got {self.min_width}")
        if self.width_step < 1:
            raise ConfigError(f"width_step must be >= 1, got {self.width_step}")
        if self.align is not None and (isinstance(self.align, bool) or not isinstance(self.align, int)
                                       or self.align < 1):
            raise ConfigError(f"align must be None (auto: {CUDA_ALIGN} on a CUDA device, 1 elsewhere) "
                              "or an integer >= 1 (every searched width a multiple of it, e.g. 8), "
                              f"got {self.align!r}")
        if self.width_temperature <= 0 or self.depth_temperature <= 0:
            raise ConfigError("temperatures must be > 0, got "
                             f"width={self.width_temperature}, depth={self.depth_temperature}")
        if self.width_only_from is not None and not 0 <= self.width_only_from <= 1:
            raise ConfigError(f"width_only_from must be in [0, 1] or None, got {self.width_only_from}")
        if not (self.search_width or self.search_depth):
            raise ConfigError("nothing to search: search_width and search_depth are both off")
        if self.cost_forward not in COST_FORWARD:
            raise ConfigError(f"cost_forward must be one of {COST_FORWARD}, got {self.cost_forward!r}")
        if not isinstance(self.verify, bool):
            raise ConfigError(f"verify must be True or False, got {self.verify!r}")
        if not isinstance(self.fold_masks, bool):
            raise ConfigError(f"fold_masks must be True or False, got {self.fold_masks!r}")
        if self.fuse_norms is not None and not isinstance(self.fuse_norms, bool):
            raise ConfigError(f"fuse_norms must be None (auto: on a CUDA device), True or False, "
                              f"got {self.fuse_norms!r}")
        if not isinstance(self.layer_uniform, bool):
            raise ConfigError(f"layer_uniform must be True or False, got {self.layer_uniform!r}")
        if self.depth_unit not in DEPTH_UNITS:
            raise ConfigError(f"depth_unit must be one of {DEPTH_UNITS} (a whole residual block, or each "
                              f"residual branch of one: attention and FFN apart), got {self.depth_unit!r}")
        if self.depth_unit == "sublayer" and self.resource == "latency":
            raise ConfigError("depth_unit='sublayer' with resource='latency': the latency profile times "
                              "whole residual blocks, not their branches; search macs or params with "
                              "sublayer depth (--resource params), or latency with depth_unit='block'")
        if self.gate_factory is not None and not callable(self.gate_factory):
            raise ConfigError(f"gate_factory must be a callable that builds a StructuralGate (e.g. a gate "
                              f"class), got {self.gate_factory!r}; None uses DMS's DifferentiableTopK")
        self.exclude = list(self.exclude)
        for name in ("keep_depth", "keep_width"):
            if isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a list of module names, got the string "
                                  f"{getattr(self, name)!r}: pass [{getattr(self, name)!r}]")
            setattr(self, name, list(getattr(self, name)))


def resolve_align(align: int | None, device: torch.device | str | None) -> int:
    """The width multiple a search keeps: ``align`` itself, or for None ("auto") what fits
    the device the model is on: :data:`CUDA_ALIGN` (8) on CUDA, whose bf16/fp16 tensor cores
    work in tiles of 8, and 1 (no alignment) anywhere else.

    Example:
        >>> resolve_align(None, "cpu"), resolve_align(None, "cuda:0"), resolve_align(4, "cpu")
        (1, 8, 4)
    """
    if align is not None:
        return int(align)
    kind = torch.device(device).type if device is not None else "cpu"
    return CUDA_ALIGN if kind == "cuda" else 1
