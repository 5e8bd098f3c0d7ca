"""The one table of the ``dmscale`` command's options (:data:`OPTIONS`), made from the fields
that declare them (:class:`RunOptions`).

Every option is declared once, on a field: the options of the search itself on the fields of
:class:`~dmscale.SearchConfig` (:func:`dmscale.core.options.option`), which :class:`RunOptions`
places by name (``searched()``), the others on the fields of :class:`RunOptions` with
:func:`~dmscale.config.declare.run_option` (flag, value converter, default, help, the subcommands
that take it, its help group; whether a resume may change it, whether a retrain inherits it).
:class:`~dmscale.config.run_config.RunConfig` is a ``RunOptions`` with its methods. The table
drives ``argparse`` (:mod:`dmscale.cli`), the keys a ``--config`` file may set
(:func:`dmscale.config.run_config.parse_mapping`), ``--print-config``, the validation of
``RunConfig`` and the option tables of ``docs/cli.md`` (``scripts/cli_tables.py``); all of these
names are importable from :mod:`dmscale.config.run_config` too.

Example:
    >>> OPTIONS_BY_NAME["structure_lr"].flag, OPTIONS_BY_NAME["task"].choices[:2]
    ('--structure-lr', ('mnist', 'digits'))
    >>> "device" in RESUME_MUTABLE, "precision" in RESUME_MUTABLE
    (True, False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dmscale.config.declare import RESUME_MUTABLE_KEY, flagged, run_option, searched, with_search_options
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
    str_list,
)

__all__ = [
    "Option",
    "OPTIONS",
    "OPTIONS_BY_NAME",
    "RESUME_MUTABLE",
    "RunOptions",
    "GROUP_TITLES",
    "TASKS",
    "PIPELINES",
    "COMMANDS",
]

TASKS = ("mnist", "digits", "imagefolder", "shakespeare", "detect", "text")
PIPELINES = ("np", "p", "p-")
COMMANDS = ("pretrain", "search", "retrain", "export", "eval", "report")
# the help groups of the options, in the order of `dmscale COMMAND --help`, with their titles
GROUP_TITLES = {
    "data": "data", "model": "model", "search": "search (DMS)", "distillation": "distillation",
    "training": "training", "run": "run", "watch": "watching a run",
    "lm_eval": "evaluating an LLM (hf: models)",
}

_ALL_TRAIN = ("pretrain", "search", "retrain")
_SEARCHING = ("search",)


@dataclass
@with_search_options(declared_options(SearchConfig))
class RunOptions:
    """The fields of :class:`~dmscale.config.run_config.RunConfig`: the command, the run it
    reads, then every option of the command in the order of ``dmscale COMMAND --help`` (and of
    ``config.yaml``). Each option is declared here, once, with
    :func:`~dmscale.config.declare.run_option`, or, for the options of the search itself
    (declared on :class:`~dmscale.SearchConfig`'s fields: help, converter, default), placed here
    by name with :func:`~dmscale.config.declare.searched`. Commands listing ``inspect`` are the
    ones that decide the model, search space and memory ``dmscale inspect`` shows.
    """

    command: str = "search"
    source: str | None = None  # the run a retrain / export / eval / report reads
    # ---- data
    task: str = run_option(
        "mnist", convert=choice(*TASKS), commands=("pretrain", "search", "inspect"), group="data",
        retrain_inherits=True,
        help="built-in task: mnist (bundled MNIST, or a directory of MNIST IDX files with --data), "
             "digits (scikit-learn 8x8 digits), imagefolder (a torchvision ImageFolder directory or "
             "WebDataset tar shards, --data PATH), shakespeare (character-level language modelling on the bundled plays), "
             "detect (object detection with Ultralytics YOLO, --data DATA.yaml), "
             "text (text, JSON Lines or Parquet files or a saved Hugging Face dataset of --data, or "
             "the bundled plays, tokenised with the tokenizer "
             "of --model hf:PATH; perplexity and bits per byte)")
    data: str | None = run_option(
        None, convert=nonempty_str, metavar="PATH",
        commands=("pretrain", "search", "retrain", "eval", "inspect"), group="data",
        retrain_inherits=True,
        help="data location: for mnist a directory with the four MNIST IDX files (raw or .gz; "
             "default: the bundled copy); for imagefolder a directory of class folders (with "
             "train/ and val/ or test/ subfolders, or one folder split 90/10), or WebDataset tar "
             "shards (KEY.jpg + KEY.cls): a .tar file, a brace pattern like 'train-{000000..000009}.tar', "
             "a glob, or a directory of .tar files (same layouts); for detect an "
             "Ultralytics dataset YAML (`dmscale data mnist-detect` writes one); for text a text "
             "file or a directory of them (last 10 %% of the bytes held out), a .jsonl or .parquet "
             "file or a directory of them, or a directory written by a Hugging Face dataset's "
             "save_to_disk (its train split); records are documents, joined by EOS, the last 10 %% "
             "of them held out")
    val_data: str | None = run_option(
        None, convert=nonempty_str, metavar="PATH",
        commands=("pretrain", "search", "retrain", "eval", "inspect"), group="data",
        retrain_inherits=True,
        help="imagefolder: the held-out images, a directory of class folders or tar shards as for "
             "--data (default: DATA/val or DATA/test next to DATA/train, else 10 %% of --data)")
    text_field: str = run_option(
        "text", convert=nonempty_str, metavar="NAME",
        commands=("pretrain", "search", "retrain", "eval", "inspect"), group="data",
        retrain_inherits=True,
        help="text: the field of the JSON Lines records, or the column of Parquet files and saved "
             "Hugging Face datasets, that holds the text")
    train_limit: int | None = run_option(
        None, convert=positive_int, metavar="N", commands=("pretrain", "search", "retrain", "inspect"),
        group="data", retrain_inherits=True,
        help="use only the first N training examples (characters for shakespeare, tokens for text)")
    test_limit: int | None = run_option(
        None, convert=positive_int, metavar="N",
        commands=("pretrain", "search", "retrain", "eval", "inspect"), group="data",
        retrain_inherits=True,
        help="use only the first N test examples (characters for shakespeare, tokens for text)")
    image_size: int | None = run_option(
        None, convert=positive_int, metavar="SIZE", commands=("pretrain", "search", "inspect"),
        group="data", retrain_inherits=True,
        help="the side of the square images the model sees, in training and evaluation. "
             "imagefolder: the crops (default: the model's input size from timm's data config for "
             "timm:NAME, 32 for the other models); detect: Ultralytics' imgsz, a multiple of 32 "
             "(default 64). --imgsz is its deprecated spelling")
    image_augment: str = run_option(
        "default", convert=choice("default", "none"), commands=("pretrain", "search"), group="data",
        retrain_inherits=True,
        help="imagefolder: training augmentation: default (random-resized crop and horizontal flip; "
             "timm's training transform for timm:NAME) or none (training images get the evaluation "
             "transform: resize and center crop)")
    auto_augment: str | None = run_option(
        None, convert=nonempty_str, metavar="POLICY", commands=("pretrain", "search"), group="data",
        retrain_inherits=True,
        help="imagefolder with --model timm:NAME: timm's augmentation policy, e.g. rand-m9-mstd0.5 "
             "(RandAugment), augmix-m5-w3, original (AutoAugment); default: none")
    # None: dmscale.data.images.default_workers()
    workers: int | None = run_option(
        None, convert=nonneg_int, metavar="N", commands=("pretrain", "search", "retrain", "eval"),
        group="data", resume_mutable=True,
        help="imagefolder: processes decoding images (default: the cores this process may use, "
             "shared among the torchrun processes of a node, at most 16; 0 = decode in the "
             "training process). Any number gives the same batches")
    augment: dict[str, Any] | None = run_option(
        None, convert=auto_or(kv_dict), cli_default="auto", metavar="K=V,...|auto",
        commands=("pretrain", "search"), group="data", retrain_inherits=True,
        help="detect: Ultralytics' training augmentation hyperparameters, e.g. mosaic=0,fliplr=0 "
             "(keys of its default.yaml: hsv_h, hsv_s, hsv_v, degrees, translate, scale, shear, "
             "perspective, flipud, fliplr, bgr, mosaic, mixup, cutmix, copy_paste; the keys not "
             "given keep Ultralytics' values). auto: fliplr=0,mosaic=0 (a mirrored digit or letter is "
             "another glyph; mosaic cuts small objects apart, and Ultralytics itself turns it off "
             "for the last 10 epochs, which is all of a short run)")
    prompt_format: str = run_option(
        "auto", convert=choice("auto", "alpaca", "chat"), commands=("pretrain", "search", "retrain", "inspect"),
        group="data", retrain_inherits=True,
        help="--task text with instruction records (a JSON array or JSON Lines of instruction / input / "
             "output): alpaca renders each with Stanford Alpaca's prompt template, chat with the "
             "tokenizer's chat template; auto: chat when the tokenizer has one, else alpaca")
    loss_on: str = run_option(
        "response", convert=choice("response", "all"), commands=("pretrain", "search", "retrain", "inspect"),
        group="data", retrain_inherits=True,
        help="instruction records: the loss on the response tokens only (LLM-Pruner's and alpaca-lora's "
             "default) or on every token")
    seq_len: int = run_option(
        64, convert=positive_int, metavar="N", commands=("pretrain", "search", "inspect"), group="data",
        retrain_inherits=True,
        help="shakespeare / text: characters / tokens per sequence")
    # ---- model
    model: str | None = run_option(
        None, convert=nonempty_str, metavar="NAME", commands=("pretrain", "search", "inspect"),
        group="model", retrain_inherits=True,
        help="the supernet: resnet (CIFAR-style ResNet-20; default for images, with width=8 for "
             "mnist and digits), smallcnn, "
             "tv:NAME (a torchvision model, e.g. tv:resnet18), timm:NAME (e.g. timm:resnet18), "
             "charcnn (causal convolutional char LM, default for shakespeare), llama (a small "
             "Llama-style causal LM, transformers' LlamaForCausalLM), yolo:YAML or yolo:FILE.pt "
             "(Ultralytics YOLO for --task detect, e.g. yolo:yolo11n.yaml; default yolo:yolov8n.yaml), "
             "hf:PATH (a local pretrained Hugging Face causal LM directory or .gguf file, for --task "
             "text with --pipeline p/p-), or package.module:factory (your own nn.Module: an importable "
             "callable given --model-args and the task facts its signature names, e.g. num_classes; "
             "the module must be importable for export, eval and retrain of the run too)")
    model_args: dict[str, Any] | None = run_option(
        None, convert=kv_dict, metavar="K=V,...", commands=("pretrain", "search", "inspect"),
        group="model", retrain_inherits=True,
        help="constructor arguments of the model, e.g. depth=20,width=16 for resnet, "
             "hidden_size=128,num_hidden_layers=4 for llama, the keyword arguments of a "
             "package.module:factory")
    expand: dict[str, float] | None = run_option(
        None, convert=expand_factors, metavar="width=W,depth=D",
        commands=("pretrain", "search", "inspect"), group="model", retrain_inherits=True,
        help="enlarge the baseline model into the supernet (DMS_np, paper A.4): multiply every "
             "width by W and the blocks per stage by D (built-in models only)")
    init: str | None = run_option(
        None, convert=nonempty_str, metavar="RUN", commands=("search",), group="model",
        help="pipeline p / p-: start from these pretrained weights (a run directory of "
             "`dmscale pretrain`, or a weights file in a format --weights reads) instead of pretraining")
    # ---- model: the weights a run starts from (tasks/start_weights.py)
    weights: str | None = run_option(
        None, convert=nonempty_str, metavar="PATH", commands=("pretrain", "search"), group="model",
        help="start the run from the weights in this local file, loaded into the model --model "
             "builds before its first phase (pretraining, or the search of pipeline np): a "
             ".safetensors file, a torch.save'd state dict, or a checkpoint dict holding one under "
             "'state_dict', 'model' or 'model_state_dict'; every key and shape must fit (the error "
             "names the first that does not). Any --model but hf: and yolo:. With --pretrained: a "
             "local copy of the library's pretrained weights, adapted like the download. A resumed "
             "run continues from its own checkpoint; with --pipeline p / p- and --pretrain-epochs 0 "
             "the weights are the pretrained supernet")
    pretrained: bool = run_option(
        False, convert=boolean, flag_kind="flag", commands=("pretrain", "search"), group="model",
        help="--model tv:NAME / timm:NAME: start from the library's pretrained weights (torchvision "
             "weights='DEFAULT', timm pretrained=True), downloaded unless cached; a classifier head "
             "for another number of classes starts random, a first convolution for another number "
             "of channels is adapted from the RGB one. Offline, give a local copy with --weights PATH")
    # ---- search
    pipeline: str = run_option(
        "np", convert=choice(*PIPELINES), commands=("search", "inspect"), group="search",
        help="np: search a randomly initialised supernet, then retrain the found model; "
             "p: pretrain (or --init), search, retrain; p-: pretrain (or --init), then train only "
             "the structural parameters (weights frozen), no retrain")
    resource: Any = searched()
    target: Any = searched()
    resource_weight: Any = searched()
    # None: auto, set by the pipeline from the search's steps
    structure_lr: float | None = run_option(
        None, convert=auto_or(positive_float), cli_default="auto", metavar="LR|auto",
        commands=_SEARCHING, group="search",
        help="learning rate of the structural parameters (Adam, no weight decay). auto: "
             "max(0.01, 0.5 / search steps), so each width or depth ratio can move 0.5 in a short "
             "search (Adam moves it about the lr per step)")
    importance: Any = searched()
    schedule: Any = searched()
    schedule_end: Any = searched()
    cost_forward: Any = searched()
    settle: Any = searched()
    settle_hold: Any = searched()
    budget_band: Any = searched()
    search_dims: str = run_option(
        "both", convert=choice("both", "width", "depth"), commands=("search", "inspect"),
        group="search",
        help="what to search: widths, depths (residual blocks per stage) or both")
    min_width: Any = searched()
    width_step: Any = searched()
    align: Any = searched()
    exclude: Any = searched()
    layer_uniform: Any = searched()
    depth_unit: Any = searched()
    width_only_from: Any = searched()
    # ---- distillation
    teacher: str | None = run_option(
        None, convert=nonempty_str, metavar="RUN|FILE|supernet",
        commands=("search", "retrain", "inspect"), group="distillation",
        help="distil from a teacher (KL divergence on the logits) during search and retraining: "
             "a run directory, a model.safetensors inside one, a torch.save'd nn.Module (.pt), or "
             "'supernet' for the pretrained supernet itself (pipelines p / p-)")
    distill_weight: float = run_option(
        1.0, convert=nonneg_float, metavar="W", commands=("search", "retrain", "inspect"),
        group="distillation",
        help="weight of the distillation loss (added to the task loss)")
    distill_temperature: float = run_option(
        1.0, convert=positive_float, metavar="T", commands=("search", "retrain"), group="distillation",
        help="softmax temperature of the distillation loss")
    distill_hidden: float = run_option(
        0.0, convert=nonneg_float, metavar="W", commands=("search", "retrain", "inspect"),
        group="distillation",
        help="weight of hidden-state distillation: W x the mean over layers of the MSE between the "
             "model's and the teacher's hidden states (same-index layers; only the final state when "
             "the depths differ; the teacher's kept channels when the search pruned the hidden "
             "size), added to the loss; Hugging Face causal LMs (hf:PATH, llama) only; "
             "0 = off")
    # ---- training
    epochs: float = run_option(
        1.0, convert=positive_float, metavar="E", commands=_ALL_TRAIN, group="training",
        help="epochs of the main phase: the search (search), pretraining (pretrain) or "
             "retraining (retrain); fractions allowed")
    pretrain_epochs: float | None = run_option(
        None, convert=nonneg_float, metavar="E", commands=_SEARCHING, group="training",
        help="pipelines p / p-: epochs of pretraining (default: --epochs)")
    retrain_epochs: float | None = run_option(
        None, convert=nonneg_float, metavar="E", commands=_SEARCHING, group="training",
        help="pipelines np / p: epochs of retraining the found model (default: --epochs; 0 skips "
             "it, run `dmscale retrain RUN` later)")
    retrain_init: str = run_option(
        "inherit", convert=choice("inherit", "scratch", "pretrained"), commands=("search", "retrain"),
        group="training",
        help="retrain the found model from the searched weights (inherit), from a random "
             "initialisation (scratch), or from the pretrained supernet's weights of the channels "
             "and blocks the search kept (pretrained: pipeline p; the weights before the search "
             "trained them under soft masks)")
    batch_size: int = run_option(
        128, convert=positive_int, metavar="N", commands=(*_ALL_TRAIN, "eval", "inspect"),
        group="training",
        help="examples (sequences) per step")
    # None: auto, the task's (dmscale.config.defaults)
    optimizer: str | None = run_option(
        None, convert=auto_or(choice("sgd", "adamw")), cli_default="auto",
        commands=(*_ALL_TRAIN, "inspect"), group="training",
        help="optimizer of the weights: sgd (momentum, nesterov) or adamw. auto: adamw for --task "
             "detect and --model hf:PATH, sgd otherwise (the summary names the choice)")
    lr: float | None = run_option(
        None, convert=auto_or(positive_float), cli_default="auto", metavar="LR|auto",
        commands=_ALL_TRAIN, group="training",
        help="peak learning rate of the weights, cosine-decayed over each phase. auto: 0.05 for "
             "sgd, 0.002 for adamw; --task detect 1e-3 (adamw) or 0.01 (sgd); hf: models 1e-4 "
             "(adamw) or 1e-3 (sgd)")
    weight_decay: float | None = run_option(
        None, convert=auto_or(nonneg_float), cli_default="auto", metavar="WD|auto", commands=_ALL_TRAIN,
        group="training",
        help="weight decay of the weights. auto: 5e-4 for sgd, 0.01 for adamw, 0 for hf: models")
    warmup: float | None = run_option(
        None, convert=auto_or(fraction), cli_default="auto", metavar="P|auto", commands=_ALL_TRAIN,
        group="training",
        help="fraction of each phase with a linear learning-rate warm-up. auto: 0.02")
    # ---- run
    seed: int = run_option(
        0, convert=integer, metavar="N", commands=(*_ALL_TRAIN, "inspect"), group="run",
        retrain_inherits=True,
        help="random seed (initialisation, data order)")
    out: str | None = run_option(
        None, convert=nonempty_str, metavar="DIR", commands=(*COMMANDS, "inspect"), group="run",
        resume_mutable=True,
        help="where to write: the run directory (pretrain, search, retrain), the exported model "
             "(export), a JSON file of the metrics (eval), the report (report)")
    name: str | None = run_option(
        None, convert=nonempty_str, metavar="NAME", commands=_ALL_TRAIN, group="run",
        help="name of the run directory under runs/ (instead of a timestamp)")
    search_trace: bool = run_option(
        True, convert=boolean, commands=("search",), group="run", resume_mutable=True,
        help="write search_trace.jsonl: per searched dimension, every few steps, its ratio and kept "
             "width, the task- and resource-loss gradients on its ratio, its cost per element and "
             "its raw importance (read it with `dmscale inspect RUN --search-trace`; it changes no "
             "value of the search)")
    checkpoint_every: int = run_option(
        100, convert=positive_int, metavar="N", commands=_ALL_TRAIN, group="run", resume_mutable=True,
        help="write the resumable checkpoint every N steps (atomically)")
    stop_after: int | None = run_option(
        None, convert=positive_int, metavar="N", commands=_ALL_TRAIN, group="run", resume_mutable=True,
        help="stop (with a checkpoint) once the run has taken N optimizer steps in total; "
             "continue it later with --resume")
    device: str = run_option(
        "auto", convert=device_value, metavar="DEVICE",
        commands=("pretrain", "search", "retrain", "eval", "inspect"), group="run", resume_mutable=True,
        help="where to train: auto picks cuda when available; cuda:N one GPU of several")
    threads: int | None = run_option(
        None, convert=positive_int, metavar="N",
        commands=("pretrain", "search", "retrain", "eval", "inspect"), group="run", resume_mutable=True,
        help="CPU threads for torch (default: the cores not busy with other work, by the load "
             "average; at least 1)")
    precision: str = run_option(
        "32", convert=choice("32", "bf16", "fp16"), commands=(*_ALL_TRAIN, "inspect"), group="run",
        help="arithmetic of the training steps: 32 (float32), bf16 (autocast to bfloat16, CPU and "
             "GPU) or fp16 (autocast to float16 with a GradScaler; an overflowing step is skipped). "
             "Parameters, structural parameters and importance stay float32")
    compile: bool = run_option(
        False, convert=boolean, flag_kind="flag", commands=_ALL_TRAIN, group="run",
        help="run the model's forward under torch.compile during training (the masks are computed "
             "eagerly; the first steps are slow while it compiles)")
    fuse_norms: Any = searched(resume_mutable=True)
    shard: str = run_option(
        "none", convert=choice("none", "fsdp"), commands=(*_ALL_TRAIN, "inspect"), group="run",
        help="under torchrun: none trains a whole copy of the model on every rank (DDP); fsdp shards "
             "weights, gradients and optimizer state over the ranks with FSDP2 (fully_shard per "
             "decoder layer / residual block, then the root), the structural parameters and "
             "importance replicated; the found model is gathered on rank 0 for the export. Not with "
             "--precision fp16 or --compile yet")
    export: str | None = run_option(
        None, convert=choice("gguf"), commands=("search", "retrain"), group="run",
        help="--model hf:PATH: also write the found model as RUN/model.gguf for llama.cpp / Ollama / "
             "LM Studio (besides RUN/hf); a model llama.cpp cannot run (layers of different sizes of "
             "Qwen3 or Gemma 3: search with --layer-uniform) is refused before the first step")
    gguf_type: str = run_option(
        "f16", convert=choice("f32", "f16", "bf16", "q8_0"), commands=("search", "retrain", "export"),
        group="run",
        help="the number type of the GGUF file's weight matrices (--export gguf, export --format gguf); "
             "norms and vectors stay f32, q8_0 falls back to f16 for rows not a multiple of 32")
    quiet: bool = run_option(
        False, convert=boolean, flag_kind="flag", commands=(*COMMANDS, "inspect"), group="run",
        resume_mutable=True,
        help="no progress bars or summaries, only errors")
    # ---- watching a run (docs/cli.md, "Watching a run")
    # N steps, or "<X>e": X epochs
    eval_every: int | str | None = run_option(
        None, convert=eval_every_value, metavar="N|Xe", commands=_ALL_TRAIN, group="watch",
        help="evaluate on the test (val) split every N steps, or every X epochs with Xe (e.g. 0.5e), "
             "of each phase (pretrain, search, retrain) and at its end; recorded in metrics.jsonl. "
             "The retraining (the pretraining of `dmscale pretrain`) keeps its best weights as "
             "best.safetensors; a search keeps none (its structure changes). Default: off (one "
             "evaluation per epoch of pretrain / retrain on at most 2000 examples, as before)")
    export_best: bool = run_option(
        False, convert=boolean, flag_kind="flag", commands=_ALL_TRAIN, group="watch",
        help="with --eval-every: model.safetensors holds the best evaluated weights of the retraining "
             "(of `dmscale pretrain`: the pretraining) instead of its last step; the summary names "
             "which it is")
    logger: str = run_option(
        "none", convert=choice("none", "tensorboard"), commands=_ALL_TRAIN, group="watch",
        help="also log losses, evaluations, the search's exact cost against the target and the kept "
             "widths and depths: tensorboard writes <run>/tensorboard/ (needs `pip install "
             "dmscale[tensorboard]`); metrics.jsonl is written either way")

    # ---- evaluating an LLM as the field reports it (docs/llm-eval.md)
    lm_eval: list[str] | None = run_option(
        None, convert=str_list, metavar="TASKS", commands=("search", "retrain", "eval"), group="lm_eval",
        resume_mutable=True,
        help="--model hf:PATH: zero-shot accuracy of the found model and of the original through "
             "lm-evaluation-harness (its own prompts and metrics: acc, acc_norm, stderr), e.g. "
             "boolq,winogrande,arc_easy,arc_challenge; in summary.json as original -> found. Needs "
             "`pip install dmscale[eval]`")
    lm_eval_data: str | None = run_option(
        None, convert=nonempty_str, metavar="DIR", commands=("search", "retrain", "eval"), group="lm_eval",
        resume_mutable=True,
        help="read each --lm-eval task's split from the official file in DIR (boolq.dev.jsonl, "
             "winogrande.dev.jsonl, arc-easy.test.jsonl, arc-challenge.test.jsonl) instead of the hub; "
             "a missing file is refused before any model is loaded")
    lm_eval_limit: int | None = run_option(
        None, convert=positive_int, metavar="N", commands=("search", "retrain", "eval"), group="lm_eval",
        resume_mutable=True,
        help="the first N examples of each --lm-eval task (default: the whole split)")
    ppl: list[str] | None = run_option(
        None, convert=str_list, metavar="FILE", flag_kind="append", commands=("search", "retrain", "eval"),
        group="lm_eval", resume_mutable=True,
        help="also the perplexity of the found and the original model on this text by --ppl-protocol "
             "(WikiText-2 wiki.test.raw, PTB ptb.test.txt); repeated or comma-separated")
    ppl_protocol: str = run_option(
        "llm-pruner", convert=choice("llm-pruner", "gptq"), commands=("search", "retrain", "eval"),
        group="lm_eval", resume_mutable=True,
        help="llm-pruner: the rows joined with two newlines, tokenised once, 128-token windows (LLM-Pruner, "
             "the DMS paper); gptq: the same with 2,048-token windows (GPTQ, Wanda)")
    ppl_limit: int | None = run_option(
        None, convert=positive_int, metavar="TOKENS", commands=("search", "retrain", "eval"), group="lm_eval",
        resume_mutable=True,
        help="the first TOKENS tokens of each --ppl text (default: all)")


OPTIONS: tuple[Option, ...] = declared_options(RunOptions)
OPTIONS_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}

# options that may differ from the saved config when a run is resumed (--precision and
# --compile may not: a resumed run must compute what the uninterrupted one would)
RESUME_MUTABLE = frozenset(flagged(RunOptions, RESUME_MUTABLE_KEY))
