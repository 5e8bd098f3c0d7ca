"""The search configuration: what to search and under which budget (:class:`SearchConfig`).

Every option of ``dmscale search`` that sets a field here is declared on that field
(:func:`dmscale.core.options.option`: its help, converter and default on the command line);
the command's parser, ``--config`` keys, ``config.yaml`` and resume are built from them.

Example:
    >>> cfg = SearchConfig(resource="params", target=0.25)
    >>> dict(cfg.budgets)
    {'params': 0.25}
    >>> SearchConfig(target=-1)
    Traceback (most recent call last):
    ...
    dmscale.core.errors.ConfigError: target must be a finite number > 0, got -1: pass a fraction of the supernet's cost (e.g. 0.5) or an absolute count > 1
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Callable, Sequence

import torch

from dmscale.core.errors import ConfigError
from dmscale.core.importance import IMPORTANCE_METRICS
from dmscale.cost.budgets import DEFAULT_BAND, DEFAULT_RESOURCE, DEFAULT_TARGET, Budgets, parse_band, parse_targets
from dmscale.cost.registry import ResourceName
from dmscale.core.options import OPTION_KEY, Option, option
from dmscale.core.topk import GateFactory
from dmscale.core.values import (align_value, auto_or, boolean, fraction, nonneg_float, open_fraction,
                                 positive_float, positive_int, str_list, unit_fraction)

__all__ = ["SearchConfig", "COST_FORWARD", "DEPTH_UNITS", "BEFORE_OPTION", "CUDA_ALIGN", "resolve_align"]

COST_FORWARD = ("soft", "exact")
DEPTH_UNITS = ("block", "sublayer")
# Options whose default changed what is searched when they were added: the value that
# reproduces a state (or run) saved before the option existed.
BEFORE_OPTION: dict[str, Any] = {"settle": 0.0, "settle_hold": False, "align": 1}
# the width multiple of ``align=None`` on a CUDA device: bf16/fp16 tensor-core tiles
CUDA_ALIGN = 8


def _about(text: str, convert: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """The metadata of a field that is not a command-line option: its description (``help``,
    as an option's) and its converter (the one check of its value, as an option's)."""
    return {"help": text, "convert": convert}


def _gate_factory(value: Any) -> GateFactory | None:
    """None (DMS's DifferentiableTopK) or a callable that builds a StructuralGate."""
    if value is not None and not callable(value):
        raise ConfigError(f"expected a callable that builds a StructuralGate (e.g. a gate class), or None "
                          f"for DMS's DifferentiableTopK; got {value!r}")
    return value


def _converter(f: Field[Any]) -> Callable[[Any], Any] | None:
    """The converter field ``f`` declares (an option's, or a plain field's), or None."""
    spec = f.metadata.get(OPTION_KEY, f.metadata)
    return spec.convert if isinstance(spec, Option) else spec.get("convert")


class _Choice:
    """The converter of a choice field: ``choices`` for the parser, and the one check of the
    value (the command line's and the library's)."""

    def __init__(self, choices: Sequence[str], message: str) -> None:
        self.choices, self._message = tuple(choices), message

    def __call__(self, value: Any) -> str:
        if value not in self.choices:
            raise ConfigError(self._message.format(value=value, choices=self.choices,
                                                   sorted=sorted(self.choices)))
        return str(value)


_SCHEDULE = _Choice(("exp", "constant"), "expected 'exp' or 'constant', got {value!r}")
_IMPORTANCE = _Choice(tuple(IMPORTANCE_METRICS), "unknown importance {value!r}: expected one of {sorted}")
_COST_FORWARD = _Choice(COST_FORWARD, "expected one of {choices}, got {value!r}")
_DEPTH_UNIT = _Choice(DEPTH_UNITS, "expected one of {choices} (a whole residual block, or each residual "
                      "branch of one: attention and FFN apart), got {value!r}")
# validated together, once, by Budgets.of (SearchConfig._check_budgets)
_BUDGET_FIELDS = ("resource", "target", "targets", "budget_band")


def _search(*, group: str = "search", inspect: bool = False, **kw: Any) -> dict[str, Any]:
    """The metadata of a field that is also an option of ``dmscale search``
    (:func:`dmscale.core.options.option`): the command's parser, ``--config`` keys,
    ``config.yaml`` and resume are built from it. ``inspect``: ``dmscale inspect`` takes it
    too (it decides the search space that command shows)."""
    return option(commands=("search", "inspect") if inspect else ("search",), group=group, **kw)


@dataclass
class SearchConfig:
    """What to search and under which budget: the options of one DMS search, given to
    :func:`~dmscale.prepare` (``dms.prepare(model, x, SearchConfig(...))``).

    Each field's ``metadata["help"]`` is its description (``dataclasses.fields(SearchConfig)``;
    the fields that are also options of ``dmscale search`` show it in ``--help`` and in
    docs/cli.md). The budgets are one value, :attr:`budgets`
    (:class:`~dmscale.cost.budgets.Budgets`), made of ``resource`` / ``target`` or ``targets``
    with ``budget_band``; the resources are those of :mod:`dmscale.cost.registry`.

    Example (every searched width a multiple of 8, in units of 16 channels):
        >>> SearchConfig(align=8, width_step=16).align
        8
        >>> SearchConfig(align=0)
        Traceback (most recent call last):
        ...
        dmscale.core.errors.ConfigError: align: expected auto (8 on a CUDA device, 1 elsewhere) or an integer >= 1 (the multiple every searched width keeps, e.g. 8), got 0
        >>> print(SearchConfig.help("normalize"))
        rank-normalise importance (Eq. 2); False is the paper's ablation
    """

    resource: str = field(default=DEFAULT_RESOURCE, metadata=_search(
        inspect=True, convert=ResourceName(),
        help="the budgeted resource (a registered one, dmscale.cost.registry): macs, params, latency "
             "(microseconds, a measured model) or kv_cache (bytes of K and V cached per token per "
             "sequence: the sum over attention layers of 2 x KV heads x head dim x dtype size)"))
    target: float = field(default=DEFAULT_TARGET, metadata=_search(
        inspect=True, convert=parse_targets, metavar="T",
        help="the budget: <= 1 is a fraction of the supernet's cost, > 1 an absolute count; several "
             "budgets at once as RESOURCE=T,RESOURCE=T (e.g. params=0.7,kv_cache=0.5; --resource is "
             "then the first of them), each met by the search, the settle phase and the budget solver"))
    resource_weight: float = field(default=1.0, metadata=_search(
        convert=auto_or(nonneg_float), cli_default="auto", metavar="W|auto",
        help="lambda_resource (Eq. 5): weight of the resource loss log(r_c / r_t). auto: 50 for a "
             "search of pipeline p / p- from a pretrained --model hf:PATH (its task loss holds the "
             "structure against a weaker one in a short search), 3 for --task detect, else 1"))
    schedule: str = field(default="exp", metadata=_search(
        convert=_SCHEDULE,
        help="target schedule: exp decays r_t from the supernet's cost to the target over the "
             "search (Eq. 10); constant uses the target from the start"))
    schedule_end: float = field(default=1.0, metadata=_search(
        convert=open_fraction, metavar="F",
        help="fraction of the search, in (0, 1], over which the exp schedule decays r_t; after it "
             "r_t holds at the target (1 = the whole search, Eq. 10 as written: the target is "
             "reached only at the last step; 0.6 leaves the last 40%% to settle on it)"))
    importance: str = field(default="taylor", metadata=_search(
        convert=_IMPORTANCE,
        help="element importance: taylor (Eq. 4, moving average of (m g)^2), snip, fisher, index"))
    normalize: bool = field(default=True, metadata=_about(
        "rank-normalise importance (Eq. 2); False is the paper's ablation", boolean))
    width_temperature: float = field(default=1.0, metadata=_about(
        "lambda = temperature x N of a width dim's top-k (A.1.1)", positive_float))
    depth_temperature: float = field(default=4.0, metadata=_about(
        "lambda = temperature x N of a depth dim's (and a head count's) top-k (A.1.1)", positive_float))
    min_width: int = field(default=1, metadata=_search(
        inspect=True, convert=positive_int, metavar="N",
        help="the smallest width any channel dimension may keep (x_min, A.1.1); attention heads and "
             "blocks are searched one at a time (dim_overrides can set a heads dim's min)"))
    width_step: int = field(default=1, metadata=_search(
        inspect=True, convert=positive_int, metavar="N",
        help="channels per search unit (a coarse search space; 1 = every channel); attention heads "
             "and blocks are searched one at a time (dim_overrides can set a heads dim's step)"))
    align: int | None = field(default=None, metadata=_search(
        inspect=True, convert=align_value, metavar="N|auto",
        help="hardware-aligned widths: keep every searched width (channels, FFN units, per-head "
             "dims) a multiple of N, searched in units of lcm(--width-step, N); head counts and "
             "blocks are counts and stay free; a width whose size is not a multiple of N is "
             "searched unaligned and named in the summary (Searcher.unaligned). auto (default): 8 "
             "when the search runs on CUDA (tensor-core tiles), 1 (off) on CPU (resolve_align; "
             "the resolved value is Searcher.align)"))
    dim_overrides: dict[str, dict[str, int]] = field(default_factory=dict, metadata=_about(
        "per width-dimension name, {'min': int, 'step': int}; with align, the step of an aligned "
        "dim must be a multiple of it (checked at prepare)"))
    search_width: bool = field(default=True, metadata=_about("search widths", boolean))
    search_depth: bool | list[str] = field(default=True, metadata=_about(
        "True: every residual stage found; False: none; a list: those stages"))
    exclude: list[str] = field(default_factory=list, metadata=_search(
        inspect=True, cli_default=None, convert=str_list, metavar="PATTERN", flag_kind="append",
        help="module names or glob patterns (e.g. 'model.layers.*.mlp') whose widths stay fixed; "
             "comma-separated or repeated"))
    width_only_from: float | None = field(default=None, metadata=_search(
        convert=fraction, metavar="P",
        help="from this fraction of the search on, freeze depth at its hard value and search "
             "widths only (the width-only phase of A.1.2); none: never"))
    latency_options: dict[str, Any] = field(default_factory=dict, metadata=_about(
        "keyword arguments of dmscale.cost.latency.LatencyCostModel (ratios, budget_s, quantile, "
        "calibrate, profile: a saved profile, e.g. measured on the target device); latency is in "
        "microseconds: a target > 1 is in us"))
    cost_forward: str = field(default="soft", metadata=_search(
        convert=_COST_FORWARD,
        help="the value of r_c in the resource loss before the settle phase: soft (the soft masks' "
             "cost, Eq. 6 as written; it sits below the export's cost while the least important kept "
             "elements have soft masks under 1) or exact (the hard masks' cost, i.e. the export's, "
             "with the soft cost's gradient: r_c = s + (h - s).detach())"))
    settle: float = field(default=0.4, metadata=_search(
        convert=unit_fraction, metavar="F",
        help="last fraction of the search, in [0, 1), that lands on the budget: the exp schedule "
             "decays over the first min(schedule_end, 1 - settle), then r_t is held at the target, "
             "r_c is the hard masks' exact cost with the soft cost's gradient, and a two-sided loss "
             "(zero inside the --budget-band, log of the distance outside) keeps it there; once the "
             "exact cost reached the target, depth is frozen and the structure lr anneals to 0 "
             "(0 = the paper's loss to the end; default 0.4, as the official code's decay_ratio 0.6)"))
    settle_hold: bool = field(default=True, metadata=_search(
        convert=boolean, metavar="BOOL",
        help="in the settle phase, once landed, hold the structure (structure lr 0) while the exact "
             "cost is inside the --budget-band, so it ends in the band once it entered it (off: the "
             "anneal alone, which keeps trading width between layers a little longer)"))
    budget_band: tuple[float, float] = field(default=DEFAULT_BAND, metadata=_search(
        convert=parse_band, metavar="LOW,HIGH",
        help="LOW,HIGH: fractions of the target, 0 < LOW <= HIGH <= 1, the settle phase lands the "
             "exact cost between (over HIGH Eq. 6's hinge, under LOW a pull back up), and under LOW "
             "the budget solver gives a found model its unused budget back (a wider band, e.g. "
             "0.95,1.0, lands coarse search spaces whose steps jump over 2 %%)"))
    verify: bool = field(default=True, metadata=_about(
        "self-checks on the example inputs (one extra forward each, tolerance in "
        "dmscale.export.verify): prepare refuses a model whose output changes with all masks open, "
        "export raises when the export does not compute what the hardened supernet computes; both "
        "name the first layer that diverges", boolean))
    layer_uniform: bool = field(default=False, metadata=_search(
        inspect=True, convert=boolean, flag_kind="flag",
        help="every repeated layer keeps the same count per kind (heads, FFN width, ...), each its "
             "own most important elements (dmscale.search.uniform); a Hugging Face model then exports "
             "with a standard config (export --format hf loads with plain from_pretrained)"))
    gate_factory: GateFactory | None = field(default=None, metadata=_about(
        "builds the gate of every width and depth dimension (None: DMS's DifferentiableTopK); for "
        "baselines and ablations, any callable with DifferentiableTopK's signature returning a "
        "StructuralGate (e.g. the paper's baselines MES, SNS and GET); export, exact cost and the "
        "export check are the same for every gate", _gate_factory))
    fold_masks: bool = field(default=True, metadata=_about(
        "multiply the masks of convolution and linear layers into their weights instead of their "
        "input activations where that is the same function (the same output, mask gradient and "
        "importance; far less memory and work on a GPU, dmscale.core.weight_masks); False: every "
        "mask on the activations, as the paper writes it; does not change what is searched (a "
        "resume may switch it)", boolean))
    fuse_norms: bool | None = field(default=None, metadata=_search(
        convert=auto_or(boolean), group="run", metavar="BOOL|auto",
        help="run the search's masked LayerNorms / RMS norms under torch.compile (a few fused kernels "
             "each instead of ~40 operators; same results up to float rounding; a resume may switch "
             "it). auto (default): on CUDA, not on CPU; a compiler failure warns once and runs them "
             "eagerly"))
    depth_unit: str = field(default="block", metadata=_search(
        inspect=True, convert=_DEPTH_UNIT,
        help="what one depth element removes: a whole residual block (block), or each residual "
             "branch of a block apart (sublayer: the search may drop the attention of one layer and "
             "the FFN of another; a layer whose branches are all removed is removed whole; a stage "
             "keeps at least its min_keep branches; not with --resource latency, whose profile times "
             "whole blocks; a Hugging Face export then needs the per-layer format, not "
             "--layer-uniform)"))
    targets: dict[str, float] | None = field(default=None, metadata=_about(
        "several budgets at once, {resource: target} (e.g. {'params': 0.7, 'kv_cache': 0.5}), each "
        "target as target's; None: the one budget resource = target. Each budget has its own "
        "resource loss term (its own r_t schedule and settle weight), summed; the settle phase and "
        "the budget solver meet every one. resource and target become the primary budget's (the "
        "first, or resource's when it names one of them)"))
    keep_depth: list[str] = field(default_factory=list, metadata=_search(
        inspect=True, cli_default=None, convert=str_list, metavar="MODULE", flag_kind="append",
        help="module names or glob patterns whose depth unit the search never removes (the block "
             "that holds each; with --depth-unit sublayer the branch, e.g. "
             "'lm.model.layers.0.self_attn'); their widths are still searched (a GGUF export needs "
             "the first layer's attention: --export gguf pins it); comma-separated or repeated"))
    keep_width: list[str] = field(default_factory=list, metadata=_search(
        inspect=True, cli_default=None, convert=str_list, metavar="MODULE", flag_kind="append",
        help="width dims the search never narrows: a layer writing the dim (name or glob, e.g. "
             "'layer3.0.conv2'), or 'residual': every width that two or more blocks write (a "
             "residual stream); comma-separated or repeated"))

    @classmethod
    def help(cls, name: str) -> str:
        """The description of field ``name`` (its ``metadata``: an option's help, or a plain
        ``help``)."""
        f = {f.name: f for f in fields(cls)}[name]
        spec = f.metadata.get(OPTION_KEY, f.metadata)
        return spec.help if isinstance(spec, Option) else spec["help"]

    @property
    def budgets(self) -> Budgets:
        """Every budget, ``{resource: target}`` (``targets``, or ``{resource: target}``), with
        ``budget_band``: one :class:`~dmscale.cost.budgets.Budgets` (a read-only mapping).

            >>> dict(SearchConfig("params", 0.3).budgets)
            {'params': 0.3}
            >>> b = SearchConfig(targets={"params": 0.7, "kv_cache": 0.5}).budgets
            >>> b == {"params": 0.7, "kv_cache": 0.5}, b.primary, b.band
            (True, 'params', (0.98, 1.0))
        """
        targets = self.targets if self.targets is not None else {self.resource: self.target}
        return Budgets(targets, self.budget_band)

    def _check_budgets(self) -> None:
        """The budgets, validated once (:meth:`Budgets.of <dmscale.cost.budgets.Budgets.of>`):
        ``targets`` normalised and ``resource`` / ``target`` made the primary budget's, and
        every budget's resource's own checks of this config (e.g. latency refuses sublayer
        depth)."""
        budgets = Budgets.of(self.resource, self.target, self.targets, self.budget_band)
        if self.targets is not None:
            self.targets = dict(budgets)
        self.resource, self.target = budgets.primary, budgets[budgets.primary]
        self.budget_band = budgets.band
        budgets.check(self)

    def __post_init__(self) -> None:
        for f in fields(self):  # every field's one check: its converter (the command line's too)
            convert = _converter(f)
            if convert is not None and f.name not in _BUDGET_FIELDS:
                setattr(self, f.name, _converted(f, convert, getattr(self, f.name)))
        self._check_budgets()
        if not (self.search_width or self.search_depth):
            raise ConfigError("nothing to search: search_width and search_depth are both off")


def _converted(f: Field[Any], convert: Callable[[Any], Any], value: Any) -> Any:
    """``convert(value)``, its error naming field ``f``; None (an option's ``auto``, which a run
    resolves) only where the field's own default is None."""
    if value is None and f.default is None:
        return None
    try:
        out = convert(value)
    except ConfigError as err:
        raise ConfigError(f"{f.name}: {err}") from None
    if out is None and f.default is not None:
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        raise ConfigError(f"{f.name}: expected a value (auto is resolved by a dmscale run, not by "
                          f"SearchConfig), got {value!r}; the default is {default!r}")
    return out


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
