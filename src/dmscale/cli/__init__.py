"""The ``dmscale`` command: pretrain, search, retrain, export, eval, report, inspect, show
and data (one function per subcommand here; the argument parser in :mod:`.parser`).

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
import time
from pathlib import Path
from typing import Any, Sequence

from dmscale.config.aliases import DEPRECATED, rename_deprecated
from dmscale.config.print_config import config_yaml
from dmscale.config.run_config import (
    OPTIONS_BY_NAME,
    ConfigError,
    RunConfig,
    load_config_file,
    load_run_config,
)
from dmscale.cli.parser import PROG, build_parser

__all__ = ["main", "build_parser"]


def _cmd_data(args: argparse.Namespace) -> int:
    from dmscale.data.mnist_detect import MnistDetectConfig, make_mnist_detect

    try:
        size = rename_deprecated({k: v for k in ("image_size", "imgsz") if (v := getattr(args, k)) is not None},
                                 f"{PROG} data")
        cfg = MnistDetectConfig(train=args.train, val=args.val, imgsz=size.get("image_size", 64),
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
    given = rename_deprecated({k: v for k, v in vars(args).items() if k in OPTIONS_BY_NAME or k in DEPRECATED},
                              f"{PROG} {command}")
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


def _cmd_train(args: argparse.Namespace, command: str) -> int:
    from dmscale.engine.ddp import from_rank0, main_rank_env, on_all_ranks, process_group
    from dmscale.run.pipeline import Pipeline
    from dmscale.run.report import format_summary

    options = _options(args, command)
    resume = _resume_dir(args, options)
    if resume is not None:
        cfg = RunConfig.for_resume(resume, command, options)
    elif command == "retrain":
        cfg = RunConfig.for_retrain(args.run, options)
    else:
        cfg = RunConfig(command=command, **options)
    if getattr(args, "print_config", False):
        print(config_yaml(cfg), end="")
        return 0
    cfg.out = cfg.out or _default_out(command, cfg.task, cfg.name)
    with process_group(cfg.device):  # torchrun: one process per rank, rank 0 writes and prints
        cfg.out = from_rank0(cfg.out)
        pipe = on_all_ranks(lambda: Pipeline(cfg, resume=resume is not None, explicit=set(options)))
        summary = pipe.run()
    if not pipe.ctx.cfg.quiet and main_rank_env():
        print(format_summary(summary))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from dmscale.run.pipeline import export_run

    out = vars(args).get("out") or str(Path(args.run) / ("" if args.format == "gguf" else "export"))
    info = export_run(args.run, out, fmt=args.format, gguf_type=vars(args).get("gguf_type") or "f16")
    if not vars(args).get("quiet"):
        print(info)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from dmscale.engine.device import resolve_device
    from dmscale.run.lm_evaluation import LM_OPTIONS, evaluate_run_lm, lm_eval_config
    from dmscale.run.pipeline import evaluate_run

    given = vars(args)
    lm_cfg = lm_eval_config(args.run, {k: given[k] for k in LM_OPTIONS if k in given})  # checked first
    overrides = {k: v for k, v in given.items()
                 if k in ("data", "val_data", "text_field", "test_limit", "batch_size", "device", "threads",
                          "workers")}
    result, text = evaluate_run(args.run, **overrides)
    if lm_cfg is not None:
        result["lm_eval"], lm_text = evaluate_run_lm(args.run, lm_cfg, resolve_device(given.get("device", "auto")),
                                                     batch_size=min(8, given.get("batch_size") or 8))
        text += "\n" + lm_text
    if given.get("out"):
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if not given.get("quiet"):
        print(text)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from dmscale.run.inspect import format_space, inspect_space

    options = rename_deprecated({k: v for k, v in vars(args).items() if k in OPTIONS_BY_NAME or k in DEPRECATED},
                                f"{PROG} inspect")
    out = options.pop("out", None)
    run = vars(args).get("run")
    if vars(args).get("search_trace") or run is not None:
        return _search_trace(run, out, bool(options.get("quiet")))
    if vars(args).get("memory"):
        from dmscale.run.inspect_memory import inspect_memory

        est = inspect_memory(RunConfig(command="search", **options), int(vars(args).get("world_size", 1)))
        if out:
            Path(out).write_text(json.dumps(est.as_dict(), indent=1) + "\n", encoding="utf-8")
        if not options.get("quiet"):
            print(est.table())
        return 0
    space = inspect_space(RunConfig(command="search", **options))
    if out:
        Path(out).write_text(json.dumps(space, indent=1) + "\n", encoding="utf-8")
    if not options.get("quiet"):
        print(format_space(space))
    return 0


def _search_trace(run: str | None, out: str | None, quiet: bool) -> int:
    """``dmscale inspect RUN --search-trace``: the search trace of a run directory."""
    from dmscale.run.inspect import format_search_trace, search_trace_summary

    if run is None:
        raise ConfigError(f"{PROG} inspect --search-trace needs RUN, a `{PROG} search` run directory")
    if not Path(run, "config.yaml").is_file():
        raise ConfigError(f"{run} is not a dmscale run directory (no config.yaml); pass a `{PROG} search` "
                          "run directory, or leave RUN out to inspect a model's search space")
    if out:
        Path(out).write_text(json.dumps(search_trace_summary(run), indent=1) + "\n", encoding="utf-8")
    if not quiet:
        print(format_search_trace(run))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from dmscale.run.inspect import show_run

    print(show_run(args.run))
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
        return {"export": _cmd_export, "eval": _cmd_eval, "report": _cmd_report, "inspect": _cmd_inspect,
                "show": _cmd_show, "data": _cmd_data}[args.command](args)
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
