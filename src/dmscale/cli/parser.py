"""The ``dmscale`` command's argument parser: one subcommand per job, every option of the
one option table (:mod:`dmscale.config.options`), on/off options as ``--x`` / ``--no-x``.

Example:
    >>> parser = build_parser()
    >>> parser.parse_args(["search", "--target", "0.4"]).target
    0.4
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from dmscale.config.aliases import DEPRECATED
from dmscale.config.options import GROUP_TITLES
from dmscale.config.run_config import OPTIONS, ConfigError, Option
from dmscale.core.values import boolean

__all__ = ["PROG", "build_parser", "INSPECT_OPTIONS"]

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
  PYTHONPATH=. dmscale search --task digits --model my_pkg.nets:build --weights my.pt  # your own model
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
    "inspect": ("show a model's search space before any training",
                "Build the model of --model for --task as `dmscale search` would (same options) and "
                "print what a search could change: every width and depth dimension, what is fixed "
                "and why, and the cost range the search space reaches against --target. Nothing "
                "is trained or written (--out FILE also writes it as JSON). --memory instead "
                "estimates the memory each rank of that search needs (weights, gradients, optimizer "
                "state, teacher, activations at --batch-size / --world-size), for --shard, "
                "--precision and --optimizer; a --model hf:DIR is built from its config.json on "
                "the meta device, without loading its weights (DIR may hold config.json alone)."),
    "show": ("print the summary of a finished run again",
             "Print the end-of-run summary of RUN (its summary.json): the cost against the "
             "target, the structure found, the evaluations."),
    "report": ("(re)write report.md and the plots of a run",
               "Write report.md and plots/*.png (kept width per layer, blocks per stage, cost "
               "against the target, loss and accuracy) for RUN."),
}

# the options of `dmscale search` that decide its model, search space and memory: those whose
# declaration lists the inspect command
INSPECT_OPTIONS = tuple(o.name for o in OPTIONS if "inspect" in o.commands)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=100)

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        return "" if isinstance(action, _OnOff) else super()._format_args(action, default_metavar)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, _OnOff):  # --x, --no-x
            return ", ".join(action.option_strings)
        return super()._format_action_invocation(action)

    def _format_usage(self, *args: Any, **kwargs: Any) -> str:
        return super()._format_usage(*args, **kwargs).replace(" ]", "]")


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


class _OnOff(argparse.Action):
    """``--x`` (on), ``--no-x`` (off), and for the old spelling ``--x true|false``."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        on = option_strings[0]
        super().__init__([on, "--no-" + on[2:]], dest, nargs="?", **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"{option_string} takes no value")
            setattr(namespace, self.dest, False)
            return
        try:
            setattr(namespace, self.dest, True if values is None else boolean(values))
        except ConfigError as err:
            parser.error(f"argument {option_string}: {err}")

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


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
            "inspect": "also write the search space as JSON to this file",
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
    if opt.flag_kind == "flag" or opt.convert is boolean:  # on/off: --x, --no-x
        group.add_argument(opt.flag, action=_OnOff, metavar="", **kw)
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
        if command in ("retrain", "export", "eval", "report", "show"):
            p.add_argument("run", metavar="RUN", nargs="?" if command == "retrain" else None,
                           help="a run directory written by `dmscale "
                                f"{'search' if command == 'retrain' else 'search/pretrain/retrain'}`")
        if command in ("pretrain", "search", "retrain"):
            p.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                           help="YAML or JSON file of options (keys as the long flags, e.g. "
                                "'structure-lr: 0.01'); flags given here win over it")
            p.add_argument("--print-config", action="store_true", default=argparse.SUPPRESS,
                           help="print the resolved options as YAML (reusable with --config) and exit")
            p.add_argument("--resume", metavar="RUN", nargs="?", const=True, default=argparse.SUPPRESS,
                           help="continue an interrupted run from its checkpoint: the run "
                                "directory (or the one given by --out); other options come "
                                "from its config.yaml")
        if command == "export":
            p.add_argument("--format", choices=["safetensors", "pt", "hf", "gguf", "onnx", "pt2"],
                           default="safetensors",
                           help="safetensors: structure.json + model.safetensors + config.yaml; "
                                "pt: also model.pt, the whole module saved with torch.save "
                                "(load with torch.load(..., weights_only=False)); hf: a Hugging "
                                "Face directory for from_pretrained, without dmscale (causal LMs "
                                "of the Llama family); gguf: OUT/model.gguf (or OUT when it ends in "
                                ".gguf) for llama.cpp / Ollama / LM Studio, see --gguf-type (Llama, "
                                "SmolLM2, Mistral, Qwen2, Qwen3); onnx: also model.onnx, checked with "
                                "onnxruntime; pt2: also model.pt2 (torch.export.load) "
                                "(default: safetensors)")
        if command == "inspect":
            p.add_argument("run", metavar="RUN", nargs="?", default=argparse.SUPPRESS,
                           help="with --search-trace: a `dmscale search` run directory")
            p.add_argument("--search-trace", action="store_true", default=argparse.SUPPRESS,
                           help="print RUN's search trace instead: per searched dimension (a residual "
                                "stream named as one), the task- and resource-loss pull on its ratio, "
                                "its cost per element and raw importance (search_trace.jsonl)")
            p.add_argument("--memory", action="store_true", default=argparse.SUPPRESS,
                           help="estimate the peak memory per rank of the search instead (docs/distributed.md)")
            p.add_argument("--world-size", type=int, default=argparse.SUPPRESS, metavar="N",
                           help="--memory: ranks (GPUs) of the run (default: 1)")
        groups: dict[str, argparse._ArgumentGroup] = {}
        for opt in OPTIONS:
            if command not in opt.commands:
                continue
            if opt.group not in groups:
                groups[opt.group] = p.add_argument_group(GROUP_TITLES[opt.group])
            _add_option(groups[opt.group], opt, command)
            for old in (o for o, n in DEPRECATED.items() if n == opt.name):  # --imgsz: not in --help
                groups[opt.group].add_argument("--" + old.replace("_", "-"), dest=old, type=_type(opt),
                                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
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
    p.add_argument("--image-size", dest="image_size", type=int, default=None, metavar="SIZE",
                   help="canvas side in pixels, at least 32 (default: 64)")
    p.add_argument("--imgsz", dest="imgsz", type=int, default=None, help=argparse.SUPPRESS)  # deprecated
    p.add_argument("--max-digits", type=int, default=3, metavar="N", help="digits per image, at most (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--quiet", action="store_true", help="print nothing")
