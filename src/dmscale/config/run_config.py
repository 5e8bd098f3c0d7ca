"""The run configuration of the ``dmscale`` command: one dataclass, one table of options.

Every option of the command line is declared once, on a field: the search's own on the fields
of :class:`~dmscale.SearchConfig`, the others on :class:`RunConfig`'s (declared in
:class:`~dmscale.config.options.RunOptions`: flag, type, default, help, the subcommands that
take it), which places both; :data:`OPTIONS` is the table they make. The same table drives
``argparse`` (see :mod:`dmscale.cli`), the keys a ``--config`` YAML/JSON file may set, and the
validation of :class:`RunConfig`. Precedence: built-in defaults < ``--config`` file < explicit
flags.

Example:
    >>> cfg = RunConfig(task="digits", target=0.4, epochs=2)
    >>> cfg.resolved().model, cfg.resolved().model_args, cfg.resolved().lr
    ('resnet', {'depth': 20, 'width': 8}, 0.05)
    >>> RunConfig(task="detect").resolved().chosen["optimizer"]  # auto: the task's choice
    'auto for detect'
    >>> parse_mapping({"structure-lr": "0.01", "expand": "width=1.5,depth=2"})["expand"]
    {'width': 1.5, 'depth': 2.0}
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from dmscale.config.declare import RETRAIN_INHERITS_KEY, flagged
from dmscale.config.options import (
    COMMANDS,
    OPTIONS,
    OPTIONS_BY_NAME,
    PIPELINES,
    RESUME_MUTABLE,
    TASKS,
    Option,
    RunOptions,
)
from dmscale.config.aliases import DEPRECATED, rename_deprecated, saved_config_keys
from dmscale.config.checks import (DEFAULT_MODELS, check_auto_augment, check_distill_hidden, check_export_best,
                                   check_retrain_init, check_start_weights)
from dmscale.config.defaults import BEFORE_AUTO, apply_defaults
from dmscale.core.errors import ConfigError
from dmscale.core.options import declared_options
from dmscale.cost.budgets import Budgets
from dmscale.search.config import BEFORE_OPTION, SearchConfig

__all__ = [
    "ConfigError",
    "Option",
    "OPTIONS",
    "RunConfig",
    "TASKS",
    "PIPELINES",
    "load_config_file",
    "parse_mapping",
    "save_config",
    "TASK_FIELDS",
    "load_run_config",
    # the option table's other names, re-exported from dmscale.config.options
    "COMMANDS",
    "OPTIONS_BY_NAME",
    "RESUME_MUTABLE",
]


# ----------------------------------------------------------------------------- run config
@dataclass
class RunConfig(RunOptions):
    """Everything a run needs; saved resolved (``config.yaml``) in the run directory.

    Its fields are :class:`~dmscale.config.options.RunOptions`' (the command, the run it reads,
    every option: each declared once there, or on :class:`~dmscale.SearchConfig`'s fields for
    the options of the search itself, which :meth:`search_config` maps back) and what the run
    fills in. ``None`` means "the default that depends on other fields" (see :meth:`resolved`);
    the options whose default is ``auto`` are chosen by the task
    (:mod:`dmscale.config.defaults`), and ``chosen`` records which were and why.
    """

    # filled by the task (classes, vocab); a retrain takes it from the search run
    task_info: dict[str, Any] = field(default_factory=dict, metadata={RETRAIN_INHERITS_KEY: True})
    chosen: dict[str, str] = field(default_factory=dict)  # options resolved from auto -> why

    def __post_init__(self) -> None:
        if self.command not in COMMANDS:
            raise ConfigError(f"command must be one of {COMMANDS}, got {self.command!r}")
        for opt in OPTIONS:
            value = getattr(self, opt.name)
            if value is None and opt.default is None:
                continue
            try:
                setattr(self, opt.name, opt.convert(value))
            except ConfigError as err:
                raise ConfigError(f"{opt.flag}: {err}") from None
        self._check_budgets()
        if self.teacher == "supernet" and self.command == "search" and self.pipeline == "np":
            raise ConfigError("--teacher supernet needs a pretrained supernet: use --pipeline p "
                              "or p-, or give a teacher run directory")
        if self.init is not None and self.command == "search" and self.pipeline == "np":
            raise ConfigError("--init loads pretrained weights, which pipeline np does not use: "
                              "use --pipeline p or p-")
        check_start_weights(self)
        hf = str(self.model or "").startswith("hf:")
        if self.export == "gguf" and not hf:
            raise ConfigError(f"--export gguf writes a Hugging Face causal LM for llama.cpp: it needs "
                              f"--model hf:PATH (this run's model is {self.model!r})")
        if hf and self.command == "search" and self.pipeline == "np":
            raise ConfigError(f"--model {self.model} is pretrained, and pipeline np would search "
                              "it from random weights: use --pipeline p (search, then finetune) "
                              "or p- (search the structure only)")
        if self.shard == "fsdp" and (self.precision == "fp16" or self.compile):
            which = "--precision fp16" if self.precision == "fp16" else "--compile"
            raise ConfigError(f"--shard fsdp does not run with {which} yet (fp16's loss scaler would "
                              "see only this rank's shard of the gradients; torch.compile of the sharded "
                              "model is untested): use --precision bf16 or 32 without --compile, or "
                              "--shard none")
        if self.task == "text" and self.model is not None and not hf:
            raise ConfigError(f"--task text needs a pretrained model with its tokenizer: "
                              f"--model hf:PATH, not --model {self.model} (the char-level "
                              "models go with --task shakespeare)")

    def _check_budgets(self) -> None:
        """The budgets of ``--resource`` / ``--target``, validated once
        (:meth:`Budgets.of <dmscale.cost.budgets.Budgets.of>`, as ``SearchConfig`` validates
        them). Several budgets (``--target RESOURCE=T,...``): the primary one (the one
        ``resources()`` and the report's cost plot show) is a ``--resource`` other than the
        default (``macs``) when it is among them (it moves first), else the first one; a
        ``--resource`` other than the default that is not among them is refused."""
        if not isinstance(self.target, dict):
            return
        try:
            budgets = Budgets.of(self.resource, self.target)
        except ConfigError as err:
            raise ConfigError(f"--target: {err}") from None
        self.target, self.resource = dict(budgets), budgets.primary

    @property
    def budgets(self) -> Budgets:
        """Every budget of a search, ``{resource: target}`` with ``--budget-band``: the
        :class:`~dmscale.cost.budgets.Budgets` its ``SearchConfig`` holds too."""
        targets = self.target if isinstance(self.target, dict) else {self.resource: self.target}
        return Budgets(targets, self.budget_band)

    # ------------------------------------------------------------------ resolution
    def resolved(self) -> RunConfig:
        """A copy with every ``None`` default that depends on other fields filled in."""
        cfg = replace(self)
        if cfg.model is None and cfg.task == "text":
            raise ConfigError("--task text needs --model hf:PATH (a local Hugging Face model "
                              "directory or .gguf file): the text is tokenised with its tokenizer")
        hf = str(cfg.model).startswith("hf:")
        if hf:  # a pretrained LM: no pretraining, distil from the original (small steps: defaults)
            if cfg.pretrain_epochs is None:
                cfg.pretrain_epochs = 0.0
            if cfg.teacher is None and cfg.command == "search":
                cfg.teacher = "supernet"
        if cfg.model is None:
            cfg.model, default_args = DEFAULT_MODELS[cfg.task]
            if cfg.model_args is None:
                cfg.model_args = dict(default_args)
        if cfg.model_args is None:
            cfg.model_args = {}
        if cfg.augment and cfg.task != "detect":
            raise ConfigError(f"--augment sets Ultralytics' detection augmentation; --task {cfg.task} "
                              "does not use it (use --task detect, or leave --augment out)")
        apply_defaults(cfg)  # optimizer, lr, weight decay, warm-up, augment, resource weight
        if cfg.exclude is None:
            cfg.exclude = []
        check_auto_augment(cfg)
        if cfg.pretrain_epochs is None:
            cfg.pretrain_epochs = cfg.epochs
        if cfg.retrain_epochs is None:
            cfg.retrain_epochs = cfg.epochs
        check_distill_hidden(cfg)
        check_export_best(cfg)
        check_retrain_init(cfg)
        return cfg

    @property
    def distills(self) -> bool:
        """Whether a run with a ``--teacher`` computes any distillation term."""
        return self.distill_weight > 0 or self.distill_hidden > 0

    @classmethod
    def for_resume(cls, run_dir: str | Path, command: str, given: dict[str, Any]) -> RunConfig:
        """The configuration that continues the run in ``run_dir``: its saved options, the
        per-invocation ones (:data:`RESUME_MUTABLE`: ``--device``, ``--stop-after``, ...) from
        their defaults, and ``given`` over them (the pipeline refuses a given option that would
        change what the run computes)."""
        saved = load_run_config(run_dir).to_dict()
        for key in RESUME_MUTABLE - {"out"}:  # per-invocation options start from their defaults
            saved[key] = OPTIONS_BY_NAME[key].default
        return cls(**{**saved, **given, "out": str(run_dir), "command": command})

    @classmethod
    def for_retrain(cls, source: str | Path | None, given: dict[str, Any]) -> RunConfig:
        """The configuration that retrains the model the search run ``source`` found: its task,
        model and seed (:data:`TASK_FIELDS`) and pipeline, with ``given`` (the options of
        ``dmscale retrain``, among them the data and its limits) over them."""
        if not source:
            raise ConfigError("retrain needs RUN, the directory of a `dmscale search` run")
        run = load_run_config(source)
        if not (Path(source) / "structure.json").is_file():
            raise ConfigError(f"{source} has no structure.json: retrain needs a search run")
        base = {k: getattr(run, k) for k in TASK_FIELDS}
        return cls(**{**base, **given, "command": "retrain", "source": str(source), "pipeline": run.pipeline})

    def search_config(self, exclude: list[str]) -> SearchConfig:
        """The library's :class:`~dmscale.SearchConfig` of this resolved run, built here and
        nowhere else: every option it declares, by name, with ``--target``'s budgets
        (:attr:`budgets`), ``--search-dims`` and ``exclude`` (the
        module names ``--exclude`` matched, expanded by the run) mapped to its fields."""
        values = {o.name: getattr(self, o.name) for o in declared_options(SearchConfig)}
        budgets = self.budgets  # --target params=0.7,kv_cache=0.5: several
        values.update(target=budgets[budgets.primary], targets=dict(budgets) if budgets.several else None,
                      exclude=list(exclude),
                      keep_depth=list(self.keep_depth or []), keep_width=list(self.keep_width or []),
                      search_width=self.search_dims in ("both", "width"),
                      search_depth=self.search_dims in ("both", "depth"))
        return SearchConfig(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}")
        return cls(**data)


# what a retrain takes from the search run it retrains (RunConfig.for_retrain): the fields
# declared retrain_inherits (the task, its data, the model, the seed, task_info)
TASK_FIELDS: tuple[str, ...] = flagged(RunConfig, RETRAIN_INHERITS_KEY)


# ----------------------------------------------------------------------------- files
def parse_mapping(data: dict[str, Any], command: str | None = None, origin: str = "config") -> dict[str, Any]:
    """Validate a mapping of option names (``structure-lr`` or ``structure_lr``) to values.

    Raises:
        ConfigError: an unknown key, a key the command does not take, or a bad value.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of option names to values, got "
                          f"{type(data).__name__}")
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        opt = OPTIONS_BY_NAME.get(DEPRECATED.get(key, key))
        if opt is None:
            valid = ", ".join(o.name.replace("_", "-") for o in OPTIONS
                              if command is None or command in o.commands)
            raise ConfigError(f"{origin}: unknown option {raw_key!r}; valid: {valid}")
        if command is not None and command not in opt.commands:
            raise ConfigError(f"{origin}: option {raw_key!r} does not apply to `dmscale {command}`")
        if value is None:
            out[key] = None
            continue
        try:
            out[key] = opt.convert(value)
        except ConfigError as err:
            raise ConfigError(f"{origin}: {raw_key}: {err}") from None
    return rename_deprecated(out, origin)


def load_config_file(path: str | Path, command: str | None = None) -> dict[str, Any]:
    """Read a YAML or JSON file of options (see :func:`parse_mapping`).

    Raises:
        ConfigError: the file is missing, not valid YAML/JSON, or holds a bad option.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: no such file: {p}")
    text = p.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"--config {p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {first}") from None
    if data is None:
        return {}
    return parse_mapping(data, command, origin=f"--config {p}")


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write ``cfg`` as YAML (atomically)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("# dmscale run configuration (resolved)\n"
                   + yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")
    tmp.replace(p)


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The resolved :class:`RunConfig` saved in ``run_dir/config.yaml``.

    Raises:
        ConfigError: ``run_dir`` is not a dmscale run directory.
    """
    p = Path(run_dir)
    f = p / "config.yaml"
    if not f.is_file():
        what = "does not exist" if not p.exists() else "has no config.yaml"
        raise ConfigError(f"{p} is not a dmscale run directory: it {what}; pass the --out "
                          "directory of a dmscale run")
    try:
        data = yaml.safe_load(f.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"{f} is not valid YAML ({type(err).__name__}); is {p} a dmscale run "
                          "directory?") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{f} does not hold a run configuration (got a {type(data).__name__}); "
                          f"is {p} a dmscale run directory?")
    data = saved_config_keys(data)  # saved with imgsz: its image_size
    for name, value in BEFORE_OPTION.items():  # a run saved before the option: its old behaviour
        data.setdefault(name, value)
    if "chosen" not in data:  # saved before per-task defaults: auto keeps meaning what it did
        for name, value in BEFORE_AUTO.items():
            if data.get(name) is None and (name != "augment" or data.get("task") == "detect"):
                data[name] = value
        data["chosen"] = {}
    try:
        return RunConfig.from_dict(data)
    except TypeError as err:
        raise ConfigError(f"{f}: {err}") from None
