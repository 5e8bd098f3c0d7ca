"""The run configuration of the ``dmscale`` command: one dataclass, one table of options.

Every option of the command line is declared once in :data:`OPTIONS` (flag, type, default,
help, the subcommands that take it). The same table drives ``argparse`` (see
:mod:`dmscale.cli`), the keys a ``--config`` YAML/JSON file may set, and the validation of
:class:`RunConfig`. Precedence: built-in defaults < ``--config`` file < explicit flags.

Example:
    >>> cfg = RunConfig(task="digits", target=0.4, epochs=2)
    >>> cfg.resolved().model, cfg.resolved().model_args, cfg.resolved().lr
    ('resnet', {'depth': 20, 'width': 8}, 0.05)
    >>> parse_mapping({"structure-lr": "0.01", "expand": "width=1.5,depth=2"})["expand"]
    {'width': 1.5, 'depth': 2.0}
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

import yaml

from .config_values import (
    boolean,
    choice,
    expand_factors,
    fraction,
    integer,
    kv_dict,
    nonneg_float,
    open_fraction,
    positive_float,
    positive_int,
    nonempty_str,
    str_list,
)
from .errors import ConfigError

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
    "load_run_config",
]

TASKS = ("mnist", "digits", "imagefolder", "shakespeare", "detect", "text")
PIPELINES = ("np", "p", "p-")
COMMANDS = ("pretrain", "search", "retrain", "export", "eval", "report")

# the model of a task when --model is not given: (name, --model-args). ResNet-20 at half
# width (8-16-32 channels) keeps the default MNIST search within a few minutes on 2 CPU cores.
DEFAULT_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mnist": ("resnet", {"depth": 20, "width": 8}),
    "digits": ("resnet", {"depth": 20, "width": 8}),
    "imagefolder": ("resnet", {"depth": 20, "width": 16}),
    "shakespeare": ("charcnn", {}),
    "detect": ("yolo:yolov8n.yaml", {}),
}  # --task text has no default: it needs --model hf:PATH (the tokenizer comes with it)


# ConfigError lives in errors.py (a DMScaleError); re-exported here for the command line.


_ALL_TRAIN = ("pretrain", "search", "retrain")
_SEARCHING = ("search",)
_RUN_DIR = ("retrain", "export", "eval", "report")


@dataclass(frozen=True)
class Option:
    """One option: ``--flag`` on the command line and ``name`` in a config file."""

    name: str
    convert: Callable[[Any], Any]
    default: Any
    help: str
    commands: tuple[str, ...]
    group: str
    metavar: str | None = None
    flag_kind: str = "value"  # "value" | "flag" (store_true) | "append"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def choices(self) -> tuple[str, ...] | None:
        return getattr(self.convert, "choices", None)


def _o(name: str, convert: Callable[[Any], Any], default: Any, help: str,
       commands: tuple[str, ...], group: str, **kw: Any) -> Option:
    return Option(name, convert, default, help, commands, group, **kw)


OPTIONS: tuple[Option, ...] = (
    # ---- data
    _o("task", choice(*TASKS), "mnist",
       "built-in task: mnist (bundled MNIST, or a directory of MNIST IDX files with --data), "
       "digits (scikit-learn 8x8 digits), imagefolder (a torchvision ImageFolder directory, "
       "--data DIR), shakespeare (character-level language modelling on the bundled plays), "
       "detect (object detection with Ultralytics YOLO, --data DATA.yaml), "
       "text (plain text files of --data, or the bundled plays, tokenised with the tokenizer "
       "of --model hf:PATH; perplexity and bits per byte)",
       ("pretrain", "search"), "data"),
    _o("data", nonempty_str, None,
       "data location: for mnist a directory with the four MNIST IDX files (raw or .gz; "
       "default: the bundled copy); for imagefolder a directory of class folders (with "
       "train/ and val/ or test/ subfolders, or one folder split 90/10); for detect an "
       "Ultralytics dataset YAML (`dmscale data mnist-detect` writes one); for text a text "
       "file or a directory of them (last 10 %% of the bytes held out)",
       ("pretrain", "search", "retrain", "eval"), "data", metavar="PATH"),
    _o("train_limit", positive_int, None,
       "use only the first N training examples (characters for shakespeare, tokens for text)",
       ("pretrain", "search", "retrain"), "data", metavar="N"),
    _o("test_limit", positive_int, None,
       "use only the first N test examples (characters for shakespeare, tokens for text)",
       ("pretrain", "search", "retrain", "eval"), "data", metavar="N"),
    _o("image_size", positive_int, 32,
       "imagefolder: images are resized to SIZE x SIZE", ("pretrain", "search"), "data",
       metavar="SIZE"),
    _o("imgsz", positive_int, None,
       "detect: training and validation image size, a multiple of 32 (Ultralytics' imgsz; "
       "default 64)", ("pretrain", "search"), "data", metavar="SIZE"),
    _o("augment", kv_dict, None,
       "detect: Ultralytics' training augmentation hyperparameters, e.g. mosaic=0,fliplr=0 "
       "(keys of its default.yaml: hsv_h, hsv_s, hsv_v, degrees, translate, scale, shear, "
       "perspective, flipud, fliplr, bgr, mosaic, mixup, cutmix, copy_paste; default: "
       "Ultralytics' values)", ("pretrain", "search"), "data", metavar="K=V,..."),
    _o("seq_len", positive_int, 64,
       "shakespeare / text: characters / tokens per sequence", ("pretrain", "search"), "data",
       metavar="N"),
    # ---- model
    _o("model", nonempty_str, None,
       "the supernet: resnet (CIFAR-style ResNet-20; default for images, with width=8 for "
       "mnist and digits), smallcnn, "
       "tv:NAME (a torchvision model, e.g. tv:resnet18), timm:NAME (e.g. timm:resnet18), "
       "charcnn (causal convolutional char LM, default for shakespeare), llama (a small "
       "Llama-style causal LM, transformers' LlamaForCausalLM), yolo:YAML or yolo:FILE.pt "
       "(Ultralytics YOLO for --task detect, e.g. yolo:yolo11n.yaml; default yolo:yolov8n.yaml), "
       "hf:PATH (a local pretrained Hugging Face causal LM directory or .gguf file, for --task "
       "text with --pipeline p/p-)",
       ("pretrain", "search"), "model", metavar="NAME"),
    _o("model_args", kv_dict, None,
       "constructor arguments of the model, e.g. depth=20,width=16 for resnet, "
       "hidden_size=128,num_hidden_layers=4 for llama",
       ("pretrain", "search"), "model", metavar="K=V,..."),
    _o("expand", expand_factors, None,
       "enlarge the baseline model into the supernet (DMS_np, paper A.4): multiply every "
       "width by W and the blocks per stage by D (built-in models only)",
       ("pretrain", "search"), "model", metavar="width=W,depth=D"),
    _o("init", nonempty_str, None,
       "pipeline p / p-: start from these pretrained weights (a run directory of "
       "`dmscale pretrain`, or its model.safetensors) instead of pretraining",
       ("search",), "model", metavar="RUN"),
    # ---- search
    _o("pipeline", choice(*PIPELINES), "np",
       "np: search a randomly initialised supernet, then retrain the found model; "
       "p: pretrain (or --init), search, retrain; p-: pretrain (or --init), then train only "
       "the structural parameters (weights frozen), no retrain",
       _SEARCHING, "search"),
    _o("resource", choice("macs", "params", "latency"), "macs",
       "the budgeted resource", _SEARCHING, "search"),
    _o("target", positive_float, 0.5,
       "the budget: <= 1 is a fraction of the supernet's cost, > 1 an absolute count",
       _SEARCHING, "search", metavar="T"),
    _o("resource_weight", nonneg_float, 1.0,
       "lambda_resource: weight of the resource loss log(r_c / r_t)", _SEARCHING, "search",
       metavar="W"),
    _o("structure_lr", positive_float, 0.01,
       "learning rate of the structural parameters (Adam, no weight decay)", _SEARCHING,
       "search", metavar="LR"),
    _o("importance", choice("taylor", "snip", "fisher", "index"), "taylor",
       "element importance: taylor (moving average of (m g)^2), snip, fisher, index",
       _SEARCHING, "search"),
    _o("schedule", choice("exp", "constant"), "exp",
       "target schedule: exp decays r_t from the supernet's cost to the target over the "
       "search; constant uses the target from the start", _SEARCHING, "search"),
    _o("schedule_end", open_fraction, 1.0,
       "fraction of the search, in (0, 1], over which the exp schedule decays r_t; after it "
       "r_t holds at the target (1 = the whole search, Eq. 10 as written)", _SEARCHING,
       "search", metavar="F"),
    _o("cost_forward", choice("soft", "exact"), "soft",
       "the value of r_c in the resource loss: soft (the soft masks' cost, Eq. 6) or exact "
       "(the hard masks' cost, i.e. the export's, with the soft cost's gradient)",
       _SEARCHING, "search"),
    _o("search_dims", choice("both", "width", "depth"), "both",
       "what to search: widths, depths (residual blocks per stage) or both", _SEARCHING,
       "search"),
    _o("min_width", positive_int, 1, "the smallest width any dimension may keep",
       _SEARCHING, "search", metavar="N"),
    _o("width_step", positive_int, 1,
       "channels per search unit (a coarse search space; 1 = every channel)", _SEARCHING,
       "search", metavar="N"),
    _o("exclude", str_list, None,
       "module names or glob patterns (e.g. 'model.layers.*.mlp') whose widths stay fixed; "
       "comma-separated or repeated", _SEARCHING, "search", metavar="PATTERN",
       flag_kind="append"),
    _o("layer_uniform", boolean, False,
       "every repeated layer keeps the same count per kind (heads, FFN width, ...), each its "
       "own most important elements; a Hugging Face model then exports with a standard config "
       "(export --format hf loads with plain from_pretrained)", _SEARCHING, "search",
       flag_kind="flag"),
    _o("width_only_from", fraction, None,
       "from this fraction of the search on, freeze depth and search widths only",
       _SEARCHING, "search", metavar="P"),
    # ---- distillation
    _o("teacher", nonempty_str, None,
       "distil from a teacher (KL divergence on the logits) during search and retraining: "
       "a run directory, a model.safetensors inside one, a torch.save'd nn.Module (.pt), or "
       "'supernet' for the pretrained supernet itself (pipelines p / p-)",
       ("search", "retrain"), "distillation", metavar="RUN|FILE|supernet"),
    _o("distill_weight", nonneg_float, 1.0,
       "weight of the distillation loss (added to the task loss)", ("search", "retrain"),
       "distillation", metavar="W"),
    _o("distill_temperature", positive_float, 1.0,
       "softmax temperature of the distillation loss", ("search", "retrain"), "distillation",
       metavar="T"),
    _o("distill_hidden", nonneg_float, 0.0,
       "weight of hidden-state distillation: W x the mean over layers of the MSE between the "
       "model's and the teacher's hidden states (same-index layers; only the final state when "
       "the depths differ), added to the loss; Hugging Face causal LMs (hf:PATH, llama) only; "
       "0 = off", ("search", "retrain"), "distillation", metavar="W"),
    # ---- training
    _o("epochs", positive_float, 1.0,
       "epochs of the main phase: the search (search), pretraining (pretrain) or "
       "retraining (retrain); fractions allowed", _ALL_TRAIN, "training", metavar="E"),
    _o("pretrain_epochs", nonneg_float, None,
       "pipelines p / p-: epochs of pretraining (default: --epochs)", _SEARCHING,
       "training", metavar="E"),
    _o("retrain_epochs", nonneg_float, None,
       "pipelines np / p: epochs of retraining the found model (default: --epochs; 0 skips "
       "it, run `dmscale retrain RUN` later)", _SEARCHING, "training", metavar="E"),
    _o("retrain_init", choice("inherit", "scratch"), "inherit",
       "retrain the found model from the searched weights (inherit) or from a random "
       "initialisation (scratch)", ("search", "retrain"), "training"),
    _o("batch_size", positive_int, 128, "examples (sequences) per step", _ALL_TRAIN + ("eval",),
       "training", metavar="N"),
    _o("optimizer", choice("sgd", "adamw"), "sgd",
       "optimizer of the weights: sgd (momentum, nesterov) or adamw", _ALL_TRAIN, "training"),
    _o("lr", positive_float, None,
       "peak learning rate of the weights, cosine-decayed over each phase "
       "(default: 0.05 for sgd, 0.002 for adamw)", _ALL_TRAIN, "training", metavar="LR"),
    _o("weight_decay", nonneg_float, None,
       "weight decay of the weights (default: 5e-4 for sgd, 0.01 for adamw)", _ALL_TRAIN,
       "training", metavar="WD"),
    _o("warmup", fraction, 0.02,
       "fraction of each phase with a linear learning-rate warm-up", _ALL_TRAIN, "training",
       metavar="P"),
    # ---- run
    _o("seed", integer, 0, "random seed (initialisation, data order)", _ALL_TRAIN, "run",
       metavar="N"),
    _o("out", nonempty_str, None,
       "where to write: the run directory (pretrain, search, retrain), the exported model "
       "(export), a JSON file of the metrics (eval), the report (report)",
       COMMANDS, "run", metavar="DIR"),
    _o("name", nonempty_str, None, "name of the run directory under runs/ (instead of a timestamp)",
       _ALL_TRAIN, "run", metavar="NAME"),
    _o("checkpoint_every", positive_int, 100,
       "write the resumable checkpoint every N steps (atomically)", _ALL_TRAIN, "run",
       metavar="N"),
    _o("stop_after", positive_int, None,
       "stop (with a checkpoint) once the run has taken N optimizer steps in total; "
       "continue it later with --resume", _ALL_TRAIN, "run", metavar="N"),
    _o("device", choice("auto", "cpu", "cuda"), "auto",
       "where to train: auto picks cuda when available", COMMANDS[:5], "run"),
    _o("threads", positive_int, None,
       "CPU threads for torch (default: the cores not busy with other work, by the load "
       "average; at least 1)",
       COMMANDS[:5], "run", metavar="N"),
    _o("precision", choice("32", "bf16", "fp16"), "32",
       "arithmetic of the training steps: 32 (float32), bf16 (autocast to bfloat16, CPU and "
       "GPU) or fp16 (autocast to float16 with a GradScaler; an overflowing step is skipped). "
       "Parameters, structural parameters and importance stay float32",
       _ALL_TRAIN, "run"),
    _o("compile", boolean, False,
       "run the model's forward under torch.compile during training (the masks are computed "
       "eagerly; the first steps are slow while it compiles)",
       _ALL_TRAIN, "run", flag_kind="flag"),
    _o("quiet", boolean, False, "no progress bars or summaries, only errors", COMMANDS, "run",
       flag_kind="flag"),
)

OPTIONS_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}

# options that may differ from the saved config when a run is resumed (--precision and
# --compile may not: a resumed run must compute what the uninterrupted one would)
RESUME_MUTABLE = frozenset({"stop_after", "checkpoint_every", "device", "threads", "quiet", "out"})


# ----------------------------------------------------------------------------- run config
@dataclass
class RunConfig:
    """Everything a run needs; saved resolved (``config.yaml``) in the run directory.

    ``None`` means "the default that depends on other fields" (see :meth:`resolved`).
    """

    command: str = "search"
    source: str | None = None  # the run a retrain / export / eval / report reads
    task: str = "mnist"
    data: str | None = None
    train_limit: int | None = None
    test_limit: int | None = None
    image_size: int = 32
    imgsz: int | None = None
    augment: dict[str, Any] | None = None
    seq_len: int = 64
    model: str | None = None
    model_args: dict[str, Any] | None = None
    expand: dict[str, float] | None = None
    init: str | None = None
    pipeline: str = "np"
    resource: str = "macs"
    target: float = 0.5
    resource_weight: float = 1.0
    structure_lr: float = 0.01
    importance: str = "taylor"
    schedule: str = "exp"
    schedule_end: float = 1.0
    cost_forward: str = "soft"
    search_dims: str = "both"
    min_width: int = 1
    width_step: int = 1
    exclude: list[str] | None = None
    width_only_from: float | None = None
    layer_uniform: bool = False
    teacher: str | None = None
    distill_weight: float = 1.0
    distill_temperature: float = 1.0
    distill_hidden: float = 0.0
    epochs: float = 1.0
    pretrain_epochs: float | None = None
    retrain_epochs: float | None = None
    retrain_init: str = "inherit"
    batch_size: int = 128
    optimizer: str = "sgd"
    lr: float | None = None
    weight_decay: float | None = None
    warmup: float = 0.02
    seed: int = 0
    out: str | None = None
    name: str | None = None
    checkpoint_every: int = 100
    stop_after: int | None = None
    device: str = "auto"
    threads: int | None = None
    precision: str = "32"
    compile: bool = False
    quiet: bool = False
    task_info: dict[str, Any] = field(default_factory=dict)  # filled by the task (classes, vocab)

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
        if self.teacher == "supernet" and self.command == "search" and self.pipeline == "np":
            raise ConfigError("--teacher supernet needs a pretrained supernet: use --pipeline p "
                              "or p-, or give a teacher run directory")
        if self.init is not None and self.command == "search" and self.pipeline == "np":
            raise ConfigError("--init loads pretrained weights, which pipeline np does not use: "
                              "use --pipeline p or p-")
        hf = str(self.model or "").startswith("hf:")
        if hf and self.command == "search" and self.pipeline == "np":
            raise ConfigError(f"--model {self.model} is pretrained, and pipeline np would search "
                              "it from random weights: use --pipeline p (search, then finetune) "
                              "or p- (search the structure only)")
        if self.task == "text" and self.model is not None and not hf:
            raise ConfigError(f"--task text needs a pretrained model with its tokenizer: "
                              f"--model hf:PATH, not --model {self.model} (the char-level "
                              "models go with --task shakespeare)")

    # ------------------------------------------------------------------ resolution
    def resolved(self) -> RunConfig:
        """A copy with every ``None`` default that depends on other fields filled in."""
        cfg = replace(self)
        if cfg.model is None and cfg.task == "text":
            raise ConfigError("--task text needs --model hf:PATH (a local Hugging Face model "
                              "directory or .gguf file): the text is tokenised with its tokenizer")
        hf = str(cfg.model).startswith("hf:")
        if hf:  # a pretrained LM: no pretraining, small steps, distil from the original
            if cfg.pretrain_epochs is None:
                cfg.pretrain_epochs = 0.0
            if cfg.lr is None:
                cfg.lr = 1e-4 if cfg.optimizer == "adamw" else 1e-3
            if cfg.weight_decay is None:
                cfg.weight_decay = 0.0
            if cfg.teacher is None and cfg.command == "search":
                cfg.teacher = "supernet"
        if cfg.model is None:
            cfg.model, default_args = DEFAULT_MODELS[cfg.task]
            if cfg.model_args is None:
                cfg.model_args = dict(default_args)
        if cfg.model_args is None:
            cfg.model_args = {}
        if cfg.lr is None:
            cfg.lr = 0.05 if cfg.optimizer == "sgd" else 0.002
        if cfg.weight_decay is None:
            cfg.weight_decay = 5e-4 if cfg.optimizer == "sgd" else 0.01
        if cfg.exclude is None:
            cfg.exclude = []
        if cfg.augment and cfg.task != "detect":
            raise ConfigError(f"--augment sets Ultralytics' detection augmentation; --task {cfg.task} "
                              "does not use it (use --task detect, or leave --augment out)")
        if cfg.pretrain_epochs is None:
            cfg.pretrain_epochs = cfg.epochs
        if cfg.retrain_epochs is None:
            cfg.retrain_epochs = cfg.epochs
        cfg._check_distill_hidden()
        return cfg

    def _check_distill_hidden(self) -> None:
        if not self.distill_hidden or self.command not in ("search", "retrain"):
            return
        if self.task not in ("text", "shakespeare"):
            raise ConfigError(f"--distill-hidden compares transformer hidden states, which the "
                              f"models of --task {self.task} do not return: use it with a "
                              "language model (--task text --model hf:PATH), or --distill-hidden 0")
        if not self.teacher:
            raise ConfigError("--distill-hidden compares the model's hidden states with a "
                              "teacher's, and this run has no teacher: give --teacher "
                              "RUN|FILE|supernet (hf: models distil from the original by "
                              "default), or --distill-hidden 0")

    @property
    def distills(self) -> bool:
        """Whether a run with a ``--teacher`` computes any distillation term."""
        return self.distill_weight > 0 or self.distill_hidden > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}")
        return cls(**data)


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
        opt = OPTIONS_BY_NAME.get(key)
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
    return out


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
    try:
        return RunConfig.from_dict(data)
    except TypeError as err:
        raise ConfigError(f"{f}: {err}") from None
