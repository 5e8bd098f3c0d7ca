"""The one table of the ``dmscale`` command's options (:data:`OPTIONS`).

Every option is declared once (flag, value converter, default, help, the subcommands that
take it, its help group): the options of the search itself on the fields of
:class:`~dmscale.SearchConfig` (:func:`dmscale.core.options.option`), which this table places
by name, the others here. The table drives ``argparse`` (:mod:`dmscale.cli`), the keys a
``--config`` file may set (:func:`dmscale.config.run_config.parse_mapping`) and the validation of
:class:`dmscale.config.run_config.RunConfig`; all of these names are importable from
:mod:`dmscale.config.run_config` too.

Example:
    >>> OPTIONS_BY_NAME["structure_lr"].flag, OPTIONS_BY_NAME["task"].choices[:2]
    ('--structure-lr', ('mnist', 'digits'))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dmscale.core.errors import ConfigError
from dmscale.core.options import Option, declared_options
from dmscale.search.config import SearchConfig
from dmscale.core.values import (
    auto_or,
    boolean,
    choice,
    device_value,
    eval_every_value,
    expand_factors,
    fraction,
    integer,
    kv_dict,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    nonempty_str,
)

__all__ = [
    "Option",
    "OPTIONS",
    "OPTIONS_BY_NAME",
    "RESUME_MUTABLE",
    "TASKS",
    "PIPELINES",
    "COMMANDS",
]

TASKS = ("mnist", "digits", "imagefolder", "shakespeare", "detect", "text")
PIPELINES = ("np", "p", "p-")
COMMANDS = ("pretrain", "search", "retrain", "export", "eval", "report")


_ALL_TRAIN = ("pretrain", "search", "retrain")
_SEARCHING = ("search",)
_RUN_DIR = ("retrain", "export", "eval", "report")


def _o(name: str, convert: Callable[[Any], Any], default: Any, help: str,
       commands: tuple[str, ...], group: str, **kw: Any) -> Option:
    return Option(name, convert, default, help, commands, group, **kw)


@dataclass(frozen=True)
class _Place:
    """Where an option declared on :class:`~dmscale.SearchConfig` stands in :data:`OPTIONS`."""

    name: str


def _search(name: str) -> _Place:
    return _Place(name)


def _table(rows: tuple[Option | _Place, ...], declared: tuple[Option, ...]) -> tuple[Option, ...]:
    """``rows`` with each place filled by the declared option of its name; a declared option
    with no place goes last in its help group (so a new field of ``SearchConfig`` is an
    option of the command with no change here)."""
    by_name = {o.name: o for o in declared}
    stale = [r.name for r in rows if isinstance(r, _Place) and r.name not in by_name]
    if stale:
        raise ConfigError(f"the option table places {stale}, which SearchConfig does not declare: "
                          "declare them with option(...) on SearchConfig, or drop their place")
    table = [by_name[r.name] if isinstance(r, _Place) else r for r in rows]
    placed = {o.name for o in table}
    for extra in (o for o in declared if o.name not in placed):
        last = max((i for i, o in enumerate(table) if o.group == extra.group), default=len(table) - 1)
        table.insert(last + 1, extra)
    return tuple(table)


# The table, in the order of `dmscale COMMAND --help`. The options of the search itself are
# declared on the fields of SearchConfig (help, converter, default: dmscale.search.config) and
# only placed here by name.
_ROWS: tuple[Option | _Place, ...] = (
    # ---- data
    _o("task", choice(*TASKS), "mnist",
       "built-in task: mnist (bundled MNIST, or a directory of MNIST IDX files with --data), "
       "digits (scikit-learn 8x8 digits), imagefolder (a torchvision ImageFolder directory or "
       "WebDataset tar shards, --data PATH), shakespeare (character-level language modelling on the bundled plays), "
       "detect (object detection with Ultralytics YOLO, --data DATA.yaml), "
       "text (text, JSON Lines or Parquet files or a saved Hugging Face dataset of --data, or "
       "the bundled plays, tokenised with the tokenizer "
       "of --model hf:PATH; perplexity and bits per byte)",
       ("pretrain", "search"), "data"),
    _o("data", nonempty_str, None,
       "data location: for mnist a directory with the four MNIST IDX files (raw or .gz; "
       "default: the bundled copy); for imagefolder a directory of class folders (with "
       "train/ and val/ or test/ subfolders, or one folder split 90/10), or WebDataset tar "
       "shards (KEY.jpg + KEY.cls): a .tar file, a brace pattern like 'train-{000000..000009}.tar', "
       "a glob, or a directory of .tar files (same layouts); for detect an "
       "Ultralytics dataset YAML (`dmscale data mnist-detect` writes one); for text a text "
       "file or a directory of them (last 10 %% of the bytes held out), a .jsonl or .parquet "
       "file or a directory of them, or a directory written by a Hugging Face dataset's "
       "save_to_disk (its train split); records are documents, joined by EOS, the last 10 %% "
       "of them held out",
       ("pretrain", "search", "retrain", "eval"), "data", metavar="PATH"),
    _o("val_data", nonempty_str, None,
       "imagefolder: the held-out images, a directory of class folders or tar shards as for "
       "--data (default: DATA/val or DATA/test next to DATA/train, else 10 %% of --data)",
       ("pretrain", "search", "retrain", "eval"), "data", metavar="PATH"),
    _o("text_field", nonempty_str, "text",
       "text: the field of the JSON Lines records, or the column of Parquet files and saved "
       "Hugging Face datasets, that holds the text", ("pretrain", "search", "retrain", "eval"),
       "data", metavar="NAME"),
    _o("train_limit", positive_int, None,
       "use only the first N training examples (characters for shakespeare, tokens for text)",
       ("pretrain", "search", "retrain"), "data", metavar="N"),
    _o("test_limit", positive_int, None,
       "use only the first N test examples (characters for shakespeare, tokens for text)",
       ("pretrain", "search", "retrain", "eval"), "data", metavar="N"),
    _o("image_size", positive_int, None,
       "the side of the square images the model sees, in training and evaluation. "
       "imagefolder: the crops (default: the model's input size from timm's data config for "
       "timm:NAME, 32 for the other models); detect: Ultralytics' imgsz, a multiple of 32 "
       "(default 64). --imgsz is its deprecated spelling",
       ("pretrain", "search"), "data", metavar="SIZE"),
    _o("image_augment", choice("default", "none"), "default",
       "imagefolder: training augmentation: default (random-resized crop and horizontal flip; "
       "timm's training transform for timm:NAME) or none (training images get the evaluation "
       "transform: resize and center crop)", ("pretrain", "search"), "data"),
    _o("auto_augment", nonempty_str, None,
       "imagefolder with --model timm:NAME: timm's augmentation policy, e.g. rand-m9-mstd0.5 "
       "(RandAugment), augmix-m5-w3, original (AutoAugment); default: none",
       ("pretrain", "search"), "data", metavar="POLICY"),
    _o("workers", nonneg_int, None,
       "imagefolder: processes decoding images (default: the cores this process may use, "
       "shared among the torchrun processes of a node, at most 16; 0 = decode in the "
       "training process). Any number gives the same batches",
       ("pretrain", "search", "retrain", "eval"), "data", metavar="N"),
    _o("augment", auto_or(kv_dict), "auto",
       "detect: Ultralytics' training augmentation hyperparameters, e.g. mosaic=0,fliplr=0 "
       "(keys of its default.yaml: hsv_h, hsv_s, hsv_v, degrees, translate, scale, shear, "
       "perspective, flipud, fliplr, bgr, mosaic, mixup, cutmix, copy_paste; the keys not "
       "given keep Ultralytics' values). auto: fliplr=0,mosaic=0 (a mirrored digit or letter is "
       "another glyph; mosaic cuts small objects apart, and Ultralytics itself turns it off "
       "for the last 10 epochs, which is all of a short run)", ("pretrain", "search"), "data",
       metavar="K=V,...|auto"),
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
       "text with --pipeline p/p-), or package.module:factory (your own nn.Module: an importable "
       "callable given --model-args and the task facts its signature names, e.g. num_classes; "
       "the module must be importable for export, eval and retrain of the run too)",
       ("pretrain", "search"), "model", metavar="NAME"),
    _o("model_args", kv_dict, None,
       "constructor arguments of the model, e.g. depth=20,width=16 for resnet, "
       "hidden_size=128,num_hidden_layers=4 for llama, the keyword arguments of a "
       "package.module:factory",
       ("pretrain", "search"), "model", metavar="K=V,..."),
    _o("expand", expand_factors, None,
       "enlarge the baseline model into the supernet (DMS_np, paper A.4): multiply every "
       "width by W and the blocks per stage by D (built-in models only)",
       ("pretrain", "search"), "model", metavar="width=W,depth=D"),
    _o("init", nonempty_str, None,
       "pipeline p / p-: start from these pretrained weights (a run directory of "
       "`dmscale pretrain`, or a weights file in a format --weights reads) instead of pretraining",
       ("search",), "model", metavar="RUN"),
    # ---- model: the weights a run starts from (tasks/start_weights.py)
    _o("weights", nonempty_str, None,
       "start the run from the weights in this local file, loaded into the model --model "
       "builds before its first phase (pretraining, or the search of pipeline np): a "
       ".safetensors file, a torch.save'd state dict, or a checkpoint dict holding one under "
       "'state_dict', 'model' or 'model_state_dict'; every key and shape must fit (the error "
       "names the first that does not). Any --model but hf: and yolo:. With --pretrained: a "
       "local copy of the library's pretrained weights, adapted like the download. A resumed "
       "run continues from its own checkpoint; with --pipeline p / p- and --pretrain-epochs 0 "
       "the weights are the pretrained supernet",
       ("pretrain", "search"), "model", metavar="PATH"),
    _o("pretrained", boolean, False,
       "--model tv:NAME / timm:NAME: start from the library's pretrained weights (torchvision "
       "weights='DEFAULT', timm pretrained=True), downloaded unless cached; a classifier head "
       "for another number of classes starts random, a first convolution for another number "
       "of channels is adapted from the RGB one. Offline, give a local copy with --weights PATH",
       ("pretrain", "search"), "model", flag_kind="flag"),
    # ---- search
    _o("pipeline", choice(*PIPELINES), "np",
       "np: search a randomly initialised supernet, then retrain the found model; "
       "p: pretrain (or --init), search, retrain; p-: pretrain (or --init), then train only "
       "the structural parameters (weights frozen), no retrain",
       _SEARCHING, "search"),
    _search("resource"),
    _search("target"),
    _search("resource_weight"),
    _o("structure_lr", auto_or(positive_float), "auto",
       "learning rate of the structural parameters (Adam, no weight decay). auto: "
       "max(0.01, 0.5 / search steps), so each width or depth ratio can move 0.5 in a short "
       "search (Adam moves it about the lr per step)", _SEARCHING,
       "search", metavar="LR|auto"),
    _search("importance"),
    _search("schedule"),
    _search("schedule_end"),
    _search("cost_forward"),
    _search("settle"),
    _search("settle_hold"),
    _search("budget_band"),
    _o("search_dims", choice("both", "width", "depth"), "both",
       "what to search: widths, depths (residual blocks per stage) or both", _SEARCHING,
       "search"),
    _search("min_width"),
    _search("width_step"),
    _search("align"),
    _search("exclude"),
    _search("layer_uniform"),
    _search("depth_unit"),
    _search("width_only_from"),
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
       "the depths differ; the teacher's kept channels when the search pruned the hidden "
       "size), added to the loss; Hugging Face causal LMs (hf:PATH, llama) only; "
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
    _o("optimizer", auto_or(choice("sgd", "adamw")), "auto",
       "optimizer of the weights: sgd (momentum, nesterov) or adamw. auto: adamw for --task "
       "detect and --model hf:PATH, sgd otherwise (the summary names the choice)", _ALL_TRAIN,
       "training"),
    _o("lr", auto_or(positive_float), "auto",
       "peak learning rate of the weights, cosine-decayed over each phase. auto: 0.05 for "
       "sgd, 0.002 for adamw; --task detect 1e-3 (adamw) or 0.01 (sgd); hf: models 1e-4 "
       "(adamw) or 1e-3 (sgd)", _ALL_TRAIN, "training", metavar="LR|auto"),
    _o("weight_decay", auto_or(nonneg_float), "auto",
       "weight decay of the weights. auto: 5e-4 for sgd, 0.01 for adamw, 0 for hf: models",
       _ALL_TRAIN, "training", metavar="WD|auto"),
    _o("warmup", auto_or(fraction), "auto",
       "fraction of each phase with a linear learning-rate warm-up. auto: 0.02", _ALL_TRAIN,
       "training", metavar="P|auto"),
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
    _o("device", device_value, "auto",
       "where to train: auto picks cuda when available; cuda:N one GPU of several",
       ("pretrain", "search", "retrain", "eval"), "run", metavar="DEVICE"),
    _o("threads", positive_int, None,
       "CPU threads for torch (default: the cores not busy with other work, by the load "
       "average; at least 1)",
       ("pretrain", "search", "retrain", "eval"), "run", metavar="N"),
    _o("precision", choice("32", "bf16", "fp16"), "32",
       "arithmetic of the training steps: 32 (float32), bf16 (autocast to bfloat16, CPU and "
       "GPU) or fp16 (autocast to float16 with a GradScaler; an overflowing step is skipped). "
       "Parameters, structural parameters and importance stay float32",
       _ALL_TRAIN, "run"),
    _o("compile", boolean, False,
       "run the model's forward under torch.compile during training (the masks are computed "
       "eagerly; the first steps are slow while it compiles)",
       _ALL_TRAIN, "run", flag_kind="flag"),
    _search("fuse_norms"),
    _o("shard", choice("none", "fsdp"), "none",
       "under torchrun: none trains a whole copy of the model on every rank (DDP); fsdp shards "
       "weights, gradients and optimizer state over the ranks with FSDP2 (fully_shard per "
       "decoder layer / residual block, then the root), the structural parameters and "
       "importance replicated; the found model is gathered on rank 0 for the export. Not with "
       "--precision fp16 or --compile yet",
       _ALL_TRAIN, "run"),
    _o("export", choice("gguf"), None,
       "--model hf:PATH: also write the found model as RUN/model.gguf for llama.cpp / Ollama / "
       "LM Studio (besides RUN/hf); a model llama.cpp cannot run (layers of different sizes of "
       "Qwen3 or Gemma 3: search with --layer-uniform) is refused before the first step",
       ("search", "retrain"), "run"),
    _o("gguf_type", choice("f32", "f16", "bf16", "q8_0"), "f16",
       "the number type of the GGUF file's weight matrices (--export gguf, export --format gguf); "
       "norms and vectors stay f32, q8_0 falls back to f16 for rows not a multiple of 32",
       ("search", "retrain", "export"), "run"),
    _o("quiet", boolean, False, "no progress bars or summaries, only errors", COMMANDS, "run",
       flag_kind="flag"),
    # ---- watching a run (docs/cli.md, "Watching a run")
    _o("eval_every", eval_every_value, None,
       "evaluate on the test (val) split every N steps, or every X epochs with Xe (e.g. 0.5e), "
       "of each phase (pretrain, search, retrain) and at its end; recorded in metrics.jsonl. "
       "The retraining (the pretraining of `dmscale pretrain`) keeps its best weights as "
       "best.safetensors; a search keeps none (its structure changes). Default: off (one "
       "evaluation per epoch of pretrain / retrain on at most 2000 examples, as before)",
       _ALL_TRAIN, "watch", metavar="N|Xe"),
    _o("export_best", boolean, False,
       "with --eval-every: model.safetensors holds the best evaluated weights of the retraining "
       "(of `dmscale pretrain`: the pretraining) instead of its last step; the summary names "
       "which it is", _ALL_TRAIN, "watch", flag_kind="flag"),
    _o("logger", choice("none", "tensorboard"), "none",
       "also log losses, evaluations, the search's exact cost against the target and the kept "
       "widths and depths: tensorboard writes <run>/tensorboard/ (needs `pip install "
       "dmscale[tensorboard]`); metrics.jsonl is written either way", _ALL_TRAIN, "watch"),
)

OPTIONS: tuple[Option, ...] = _table(_ROWS, declared_options(SearchConfig))
OPTIONS_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}

# options that may differ from the saved config when a run is resumed (--precision and
# --compile may not: a resumed run must compute what the uninterrupted one would)
RESUME_MUTABLE = frozenset({"stop_after", "checkpoint_every", "device", "threads", "workers", "quiet", "out",
                            "fuse_norms"})
