"""The ``dmscale`` command: pretrain, search, retrain, export, eval and report.

``dmscale search`` with no options searches a ResNet on the bundled MNIST under half of its
MACs, retrains the found model and prints where the report is. Every option can also come
from a YAML/JSON file (``--config``); explicit flags win over the file, the file over the
defaults, and the resolved configuration is saved as ``config.yaml`` in the run directory.

Example:
    >>> import contextlib, io
    >>> buf = io.StringIO()
    >>> with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
    ...     _ = main(["--version"])
    >>> buf.getvalue().startswith("dmscale ")
    True
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Sequence

from dmscale.config.run_config import (
    OPTIONS,
    OPTIONS_BY_NAME,
    RESUME_MUTABLE,
    ConfigError,
    Option,
    RunConfig,
    load_config_file,
    load_run_config,
)

__all__ = ["main", "build_parser"]

PROG = "dmscale"

_DESCRIPTION = """\
Differentiable Model Scaling (DMS, ICML 2024): learn how wide and how deep a network
should be under a MACs, parameter or latency budget, then export the smaller model.

Start with `dmscale search`: no data to bring, it searches a ResNet-20 on the bundled MNIST
for a model with half the MACs, retrains it and writes a report (a few minutes on a CPU)."""

_EPILOG = """\
pipelines (paper Table 1):
  np   search a randomly initialised supernet, retrain the found model (default)
  p    pretrain the supernet (or --init RUN), search, retrain
  p-   pretrain (or --init RUN), then train only the structural parameters; no retrain

examples:
  dmscale search                                   # MNIST, ResNet-20, half the MACs
  dmscale search --target 0.3 --expand width=1.5,depth=2 --epochs 2
  dmscale search --task digits --model smallcnn --resource params --target 0.25
  dmscale search --task shakespeare --target 0.4   # char-level LM, reports bits/char
  dmscale pretrain --out runs/base && dmscale search --pipeline p- --init runs/base
  dmscale search --stop-after 100 --out runs/a && dmscale search --resume runs/a
  dmscale eval runs/a        dmscale report runs/a        dmscale export runs/a --format pt
  dmscale data mnist-detect --out data/digits-det && \
    dmscale search --task detect --model yolo:yolov8n.yaml --data data/digits-det/data.yaml

Run `dmscale COMMAND --help` for the options of a command."""

_COMMAND_HELP = {
    "pretrain": ("train the (optionally --expand'ed) supernet normally",
                 "Train the supernet with plain SGD/AdamW. The run directory can then be "
                 "given to `dmscale search --pipeline p|p- --init RUN` or as a --teacher."),
    "search": ("search width and depth under a budget (the DMS pipelines)",
               "Run a DMS pipeline: np (search a random supernet, retrain), p (pretrain, "
               "search, retrain) or p- (pretrain, structure-only search). Writes config.yaml, "
               "structure.json, model.safetensors, metrics.jsonl, a resumable checkpoint and "
               "report.md with plots into the run directory."),
    "retrain": ("train the model found by a search run",
                "Build the structure of RUN (a `dmscale search` run directory) and train it, "
                "from the searched weights (--retrain-init inherit) or from scratch, into a new "
                "run directory."),
    "export": ("write the found model of a run as safetensors, ONNX, pt2 or a pickled module",
               "Rebuild the found model of RUN and write structure.json, model.safetensors and "
               "config.yaml (reloadable with `dmscale eval` and dmscale.apply_structure) to "
               "--out. An unfinished search is exported from its checkpoint: the structure "
               "its hard masks select now. --format onnx / pt2 also write model.onnx (torch.onnx, "
               "checked in onnxruntime; needs `pip install dmscale[deploy]`) or model.pt2 "
               "(torch.export), for the task's input shape at batch 1."),
    "eval": ("evaluate the model of a run on the test split",
             "Rebuild the model of RUN (supernet from config.yaml, dmscale.apply_structure with "
             "structure.json, weights from model.safetensors), evaluate it and print accuracy "
             "(or bits per character), MACs and parameters."),
    "report": ("(re)write report.md and the plots of a run",
               "Write report.md and plots/*.png (kept width per layer, blocks per stage, cost "
               "against the target, loss and accuracy) for RUN."),
}

_GROUP_TITLES = {
    "data": "data", "model": "model", "search": "search (DMS)", "distillation": "distillation",
    "training": "training", "run": "run",
}


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=100)


def _type(opt: Option) -> Any:
    def convert(text: str) -> Any:
        try:
            return opt.convert(text)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = opt.name
    return convert


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``dmscale search: error: ...``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class _ExtendList(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        current = list(getattr(namespace, self.dest, None) or [])
        setattr(namespace, self.dest, current + list(values))


def _default_text(opt: Option) -> str:
    if opt.default is None or opt.flag_kind == "flag":
        return ""
    return f" (default: {opt.default})"


def _add_option(group: argparse._ArgumentGroup, opt: Option, command: str) -> None:
    help_text = opt.help
    if opt.name == "out":
        help_text = {
            "export": "where to write the exported model (default: RUN/export)",
            "eval": "also write the metrics as JSON to this file",
            "report": "where to write report.md and plots/ (default: RUN)",
            "retrain": "run directory of the retraining (default: runs/retrain-<task>-<time>)",
        }.get(command, f"run directory (default: runs/{command}-<task>-<time>)")
    if opt.name == "epochs":
        help_text = {
            "pretrain": "epochs of pretraining; fractions allowed",
            "retrain": "epochs of retraining; fractions allowed",
            "search": "epochs of the search phase (pretraining and retraining default to it); "
                      "fractions allowed",
        }[command]
    if opt.name == "device" and command == "eval":
        help_text = "where to evaluate: auto picks cuda when available"
    kw: dict[str, Any] = {"dest": opt.name, "default": argparse.SUPPRESS,
                          "help": help_text + _default_text(opt)}
    if opt.flag_kind == "flag":
        group.add_argument(opt.flag, action="store_true", **kw)
        return
    if opt.choices:
        kw["choices"] = list(opt.choices)
    else:
        kw["type"] = _type(opt)
        kw["metavar"] = opt.metavar or opt.name.upper()
    if opt.flag_kind == "append":
        kw["action"] = _ExtendList
    group.add_argument(opt.flag, **kw)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dmscale`` command."""
    from dmscale import __version__

    parser = _Parser(prog=PROG, description=_DESCRIPTION, epilog=_EPILOG, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for command, (short, long) in _COMMAND_HELP.items():
        p = sub.add_parser(command, help=short, description=textwrap.fill(long, 96),
                           formatter_class=_Formatter)
        if command in ("retrain", "export", "eval", "report"):
            p.add_argument("run", metavar="RUN", nargs="?" if command == "retrain" else None,
                           help="a run directory written by `dmscale "
                                f"{'search' if command == 'retrain' else 'search/pretrain/retrain'}`")
        if command in ("pretrain", "search", "retrain"):
            p.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                           help="YAML or JSON file of options (keys as the long flags, e.g. "
                                "'structure-lr: 0.01'); flags given here win over it")
            p.add_argument("--resume", metavar="RUN", nargs="?", const=True, default=argparse.SUPPRESS,
                           help="continue an interrupted run from its checkpoint: the run "
                                "directory (or the one given by --out); other options come "
                                "from its config.yaml")
        if command == "export":
            p.add_argument("--format", choices=["safetensors", "pt", "hf", "onnx", "pt2"],
                           default="safetensors",
                           help="safetensors: structure.json + model.safetensors + config.yaml; "
                                "pt: also model.pt, the whole module saved with torch.save "
                                "(load with torch.load(..., weights_only=False)); hf: a Hugging "
                                "Face directory for from_pretrained, without dmscale (causal LMs "
                                "of the Llama family); onnx: also model.onnx, checked with "
                                "onnxruntime; pt2: also model.pt2 (torch.export.load) "
                                "(default: safetensors)")
        groups: dict[str, argparse._ArgumentGroup] = {}
        for opt in OPTIONS:
            if command not in opt.commands:
                continue
            if opt.group not in groups:
                groups[opt.group] = p.add_argument_group(_GROUP_TITLES[opt.group])
            _add_option(groups[opt.group], opt, command)
    _add_data_parser(sub)
    return parser


def _add_data_parser(sub: Any) -> None:
    """``dmscale data mnist-detect``: write an offline dataset (see :mod:`dmscale.data`)."""
    p = sub.add_parser("data", help="write an offline dataset (mnist-detect: YOLO-format detection)",
                       description="Write a small YOLO-format detection dataset (MNIST digits at "
                                   "random positions and scales on a canvas, one class per digit) "
                                   "and its data.yaml, for `dmscale search --task detect`.",
                       formatter_class=_Formatter)
    p.add_argument("dataset", choices=["mnist-detect"], help="the dataset to write")
    p.add_argument("--out", required=True, metavar="DIR", help="an empty or new directory")
    p.add_argument("--train", type=int, default=512, metavar="N", help="training images (default: 512)")
    p.add_argument("--val", type=int, default=128, metavar="N", help="validation images (default: 128)")
    p.add_argument("--imgsz", type=int, default=64, metavar="SIZE", help="canvas side in pixels (default: 64)")
    p.add_argument("--max-digits", type=int, default=3, metavar="N", help="digits per image, at most (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--quiet", action="store_true", help="print nothing")


def _cmd_data(args: argparse.Namespace) -> int:
    from dmscale.data.mnist_detect import MnistDetectConfig, make_mnist_detect

    try:
        cfg = MnistDetectConfig(train=args.train, val=args.val, imgsz=args.imgsz,
                                max_digits=args.max_digits, seed=args.seed)
        info = make_mnist_detect(args.out, cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not args.quiet:
        print(f"wrote {info['images']['train']} training and {info['images']['val']} validation images "
              f"({info['objects']['train']} + {info['objects']['val']} digits)\n  dataset: {info['yaml']}")
    return 0


# ----------------------------------------------------------------------------- commands
def _default_out(command: str, task: str, name: str | None) -> str:
    if name:
        return str(Path("runs") / name)
    base = Path("runs") / f"{command}-{task}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return str(path)


def _options(args: argparse.Namespace, command: str) -> dict[str, Any]:
    given = {k: v for k, v in vars(args).items() if k in OPTIONS_BY_NAME}
    from_file = load_config_file(args.config, command) if getattr(args, "config", None) else {}
    return {**from_file, **given}


def _resume_dir(args: argparse.Namespace, options: dict[str, Any]) -> str | None:
    resume = getattr(args, "resume", None)
    if resume is None:
        return None
    if isinstance(resume, str):
        if options.get("out") not in (None, resume):
            raise ConfigError(f"--resume {resume} and --out {options['out']} name different runs")
        return resume
    if not options.get("out"):
        raise ConfigError("--resume needs the run directory: --resume RUN (or --out RUN)")
    return str(options["out"])


TASK_FIELDS = ("task", "data", "train_limit", "test_limit", "image_size", "image_augment", "auto_augment",
               "imgsz", "augment", "seq_len", "model", "model_args", "expand", "task_info", "seed")


def _cmd_train(args: argparse.Namespace, command: str) -> int:
    from dmscale.engine.ddp import from_rank0, main_rank_env, on_all_ranks, process_group
    from dmscale.run.pipeline import Pipeline
    from dmscale.run.report import format_summary

    options = _options(args, command)
    resume = _resume_dir(args, options)
    if resume is not None:
        saved = load_run_config(resume).to_dict()
        for key in RESUME_MUTABLE - {"out"}:  # per-invocation options start from their defaults
            saved[key] = OPTIONS_BY_NAME[key].default
        cfg = RunConfig(**{**saved, **options, "out": resume, "command": command})
    elif command == "retrain":
        if not args.run:
            raise ConfigError("retrain needs RUN, the directory of a `dmscale search` run")
        source = load_run_config(args.run)
        if not (Path(args.run) / "structure.json").is_file():
            raise ConfigError(f"{args.run} has no structure.json: retrain needs a search run")
        base = {k: getattr(source, k) for k in TASK_FIELDS}
        for k in ("data", "train_limit", "test_limit", "seed"):
            if k in options:
                base[k] = options[k]
        merged = {**base, **options, "command": "retrain", "source": str(args.run),
                  "pipeline": source.pipeline}
        merged["out"] = merged.get("out") or _default_out("retrain", source.task, merged.get("name"))
        cfg = RunConfig(**merged)
    else:
        cfg = RunConfig(command=command, **options)
        cfg.out = cfg.out or _default_out(command, cfg.task, cfg.name)
    with process_group(cfg.device):  # torchrun: one process per rank, rank 0 writes and prints
        cfg.out = from_rank0(cfg.out)
        pipe = on_all_ranks(lambda: Pipeline(cfg, resume=resume is not None, explicit=set(options)))
        summary = pipe.run()
    if not pipe.cfg.quiet and main_rank_env():
        print(format_summary(summary))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from dmscale.run.pipeline import export_run

    out = vars(args).get("out") or str(Path(args.run) / "export")
    info = export_run(args.run, out, fmt=args.format)
    if not vars(args).get("quiet"):
        print(info)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from dmscale.run.pipeline import evaluate_run

    overrides = {k: v for k, v in vars(args).items()
                 if k in ("data", "test_limit", "batch_size", "device", "threads", "workers")}
    result, text = evaluate_run(args.run, **overrides)
    if vars(args).get("out"):
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if not vars(args).get("quiet"):
        print(text)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from dmscale.run.report import write_report

    load_run_config(args.run)  # a clear error when RUN is not a run directory
    path = write_report(args.run, vars(args).get("out"))
    if not vars(args).get("quiet"):
        print(f"report: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dmscale`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from dmscale.engine.ddp import main_rank_env
    from dmscale.core.errors import DMScaleError
    from dmscale.run.pipeline import Stopped

    def say(message: str) -> None:  # under torchrun every rank meets the same error: rank 0 says it
        if main_rank_env():
            print(message, file=sys.stderr)

    try:
        if args.command in ("pretrain", "search", "retrain"):
            return _cmd_train(args, args.command)
        return {"export": _cmd_export, "eval": _cmd_eval, "report": _cmd_report,
                "data": _cmd_data}[args.command](args)
    except ConfigError as err:
        say(f"{PROG} {args.command}: error: {err}")
        return 2
    except DMScaleError as err:  # a model, structure or check dmscale refuses: no traceback
        say(f"{PROG} {args.command}: error: {err}")
        return 1
    except Stopped as stop:
        import signal

        why = "--stop-after" if stop.signal is None else signal.Signals(stop.signal).name
        say(f"{PROG} {args.command}: stopped after {stop.global_step} steps ({why}), checkpoint "
            f"written; continue with: {PROG} {args.command} --resume {stop.run_dir}")
        return 0 if stop.signal is None else 128 + stop.signal
    except KeyboardInterrupt:
        say(f"\n{PROG} {args.command}: interrupted; a run continues from its last checkpoint "
            f"with --resume RUN")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
