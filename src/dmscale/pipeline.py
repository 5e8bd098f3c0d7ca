"""The pipelines of the ``dmscale`` command: phases, training loops, run directory, resume.

A run is a sequence of *phases* (paper Table 1):

============  ==========================================================
``np``        search (randomly initialised supernet) -> retrain
``p``         pretrain (or ``--init``) -> search -> retrain
``p-``        pretrain (or ``--init``) -> search of the structure only
``pretrain``  pretrain (the ``dmscale pretrain`` command)
``retrain``   retrain a found structure (the ``dmscale retrain`` command)
============  ==========================================================

Search loss: ``task + searcher.resource_loss(progress=step / total)`` (+ distillation);
weights use SGD or AdamW with warm-up + cosine decay, the structural parameters Adam with
no weight decay. In ``p-`` the weights are frozen (``requires_grad=False``) and only the
structural parameters are optimised.

The run directory holds ``config.yaml`` (resolved), ``state.json`` (phases done, steps),
``metrics.jsonl``, ``checkpoint.pt`` (written atomically every ``--checkpoint-every`` steps:
model, optimisers, schedulers, ``searcher.state_dict()``, RNG states, step), and the
outputs: ``supernet.safetensors`` (pretrained supernet), ``structure.json`` and
``model.safetensors`` (the found model), ``summary.json``, ``report.md`` with plots.
Batches are a pure function of ``(seed, phase, step)``, so a resumed run computes exactly
what an uninterrupted one does.

Example:
    >>> import tempfile
    >>> from dmscale.config import RunConfig
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     cfg = RunConfig(command="pretrain", task="digits", train_limit=64, test_limit=32,
    ...                     model="smallcnn", model_args={"width": 4, "blocks": 1},
    ...                     batch_size=32, epochs=1, quiet=True, out=tmp + "/run")
    ...     summary = Pipeline(cfg).run()
    ...     model, _ = load_run_model(tmp + "/run")
    >>> summary["steps"], type(model).__name__
    (2, 'SmallCNN')
"""

from __future__ import annotations

import copy
import fnmatch
import json
import math
import os
import random
import shutil
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import dmscale as dms

from . import io as _io
from .config import (
    OPTIONS_BY_NAME,
    RESUME_MUTABLE,
    ConfigError,
    RunConfig,
    load_run_config,
    save_config,
)
from .deploy import check_onnx, check_pt2, save_pickled, to_onnx, to_pt2
from .errors import NonFiniteLossError, WriteError
from .io import save_weights
from .report import posthoc_line
from .tasks.hf_model import HF_DIR, is_hf_model, save_hf_dir
from .tasks.registry import Task, build_model, build_task, distill_loss

__all__ = [
    "Pipeline",
    "Stopped",
    "RunDir",
    "load_run_model",
    "load_teacher",
    "phases_of",
    "save_weights",
    "load_weights",
    "resolve_device",
    "recalibrate_batchnorm",
    "export_run",
    "evaluate_run",
]

PHASE_SEED = {"pretrain": 1, "search": 2, "finish": 3, "retrain": 4}
CHECKPOINT_VERSION = 1
FINISH_STEPS = 300  # structure-only steps allowed after the search to get under the target
BUDGET_FILL = 0.98  # a found model under this fraction of its target gets the unused budget back
BN_CALIBRATION_BATCHES = 20  # batches that re-estimate BatchNorm statistics of the export


MAX_NON_FINITE_STEPS = 3  # a run stops after this many consecutive non-finite losses


class Stopped(Exception):
    """The run stopped with a checkpoint (at ``--stop-after``, or on SIGINT/SIGTERM: then
    ``signal`` is the signal's number); ``--resume`` continues it."""

    def __init__(self, run_dir: Path, global_step: int, signal: int | None = None) -> None:
        super().__init__(f"stopped after {global_step} steps")
        self.run_dir = run_dir
        self.global_step = global_step
        self.signal = signal


class _StopOnSignals:
    """While active, SIGINT and SIGTERM only set :attr:`received`; the step loop then writes
    a checkpoint and stops. A second signal of the same kind interrupts at once (as before).
    Does nothing outside the main thread, where handlers cannot be installed."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # asked twice: stop now
            raise KeyboardInterrupt
        self.received = signum

    def __enter__(self) -> "_StopOnSignals":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ----------------------------------------------------------------------------- files
def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """:func:`dmscale.io.load_weights` with its errors as :class:`ConfigError` (one line)."""
    try:
        return _io.load_weights(model, path)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(str(err)) from None


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def set_threads(threads: int | None) -> int:
    """Set torch's CPU threads: ``threads``, or by default the idle cores (at least 1).

    torch uses every core by default; when other processes keep them busy, OpenMP threads
    that wait on each other make a step several times slower than one thread would.
    """
    if threads is None:
        cores = os.cpu_count() or 1
        try:
            busy = os.getloadavg()[0]
        except (AttributeError, OSError):
            busy = 0.0
        threads = max(1, min(torch.get_num_threads(), cores - int(busy + 0.5)))
    torch.set_num_threads(threads)
    return threads


class RunDir:
    """The files of one run directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoint.pt"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    def read_json(self, name: str, default: Any = None) -> Any:
        p = self.path / name
        if not p.is_file():
            return default
        return json.loads(p.read_text(encoding="utf-8"))

    def write_json(self, name: str, obj: Any) -> None:
        _atomic_write_text(self.path / name, json.dumps(obj, indent=1, default=_jsonable) + "\n")

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.metrics, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")

    def metrics_size(self) -> int:
        return self.metrics.stat().st_size if self.metrics.exists() else 0

    def truncate_metrics(self, size: int) -> None:
        if self.metrics.exists():
            with open(self.metrics, "r+b") as f:
                f.truncate(size)

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """Write the checkpoint to a temporary file, then move it into place: a kill or a
        full disk never leaves a broken ``checkpoint.pt``; the previous one survives."""
        tmp = self.checkpoint.with_name("checkpoint.pt.tmp")
        try:
            torch.save(state, tmp)
            os.replace(tmp, self.checkpoint)
        except OSError as err:  # e.g. no space left on device
            tmp.unlink(missing_ok=True)
            kept = (f"the previous checkpoint {self.checkpoint} is intact" if self.checkpoint.exists()
                    else "no earlier checkpoint exists")
            raise WriteError(f"cannot write {self.checkpoint}: {err.strerror or err}; {kept}. Free space "
                             f"in {self.path} and continue with --resume {self.path}") from None


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON-able: {type(obj).__name__}")


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def phases_of(cfg: RunConfig) -> list[str]:
    """The phases a run of ``cfg`` goes through."""
    if cfg.command == "pretrain":
        return ["pretrain"]
    if cfg.command == "retrain":
        return ["retrain"]
    phases: list[str] = []
    if cfg.pipeline in ("p", "p-") and cfg.init is None and not (
            is_hf_model(cfg.model) and not cfg.pretrain_epochs):  # hf: already pretrained
        if not cfg.pretrain_epochs:
            raise ConfigError(f"pipeline {cfg.pipeline} needs a pretrained supernet: "
                              "--pretrain-epochs > 0 or --init RUN")
        phases.append("pretrain")
    phases.append("search")
    if cfg.pipeline in ("np", "p") and cfg.retrain_epochs:
        phases.append("retrain")
    return phases


def _expand_patterns(model: nn.Module, patterns: list[str]) -> list[str]:
    names = [n for n, _ in model.named_modules() if n]
    out: list[str] = []
    for pat in patterns:
        if any(ch in pat for ch in "*?["):
            hits = [n for n in names if fnmatch.fnmatchcase(n, pat)]
        else:
            hits = [pat] if any(n == pat or n.startswith(pat + ".") for n in names) else []
        if not hits:
            examples = ", ".join(names[:3])
            raise ConfigError(f"--exclude {pat!r} matches no module of the model "
                              f"(its module names look like: {examples})")
        out.extend(hits)
    return out


def _calibrated_resource_loss(searcher: dms.Searcher, weight: float) -> torch.Tensor:
    """The resource loss against the final target, with the soft cost scaled by the current
    hard/soft ratio (detached).

    With few channels per dimension the soft cost r_c can sit well below the exact cost of
    the hard masks (a dimension kept whole still has soft masks of 0.5 - 0.9 on its least
    important channels), so a search can meet its target in soft terms and export a model
    over it. The finish phase pushes on the calibrated cost until the hard cost is under.
    """
    res = searcher.resources()
    soft = searcher.soft_cost()
    ratio = res["hard"] / max(res["soft"], 1e-12)
    calibrated = soft * ratio
    if float(calibrated.detach()) <= res["target"]:
        return soft.new_zeros(()).float()
    return (max(weight, 1.0) * torch.log(calibrated / res["target"])).float()


def recalibrate_batchnorm(model: nn.Module, task: Task, batch_size: int, seed: int,
                          device: torch.device | str = "cpu", n_batches: int = BN_CALIBRATION_BATCHES) -> int:
    """Re-estimate the running statistics of every BatchNorm layer of ``model`` on training
    batches (no gradients, weights untouched); returns the number of layers.

    The statistics a supernet collects during the search are those of soft masks (channels
    scaled by 0.5 - 0.9, blocks partly on); the exported model computes hard-masked
    activations, so its inherited running statistics are off until re-estimated.
    """
    def batches():
        for step in range(n_batches):
            x, _ = task.train_batch(step, batch_size, seed)
            yield x.to(device)

    with torch.random.fork_rng(devices=[]):
        return dms.recalibrate_batchnorm(model, batches(), forward=task.forward)


# ----------------------------------------------------------------------------- models
def _new_supernet(cfg: RunConfig, info: dict[str, Any], seed: int) -> tuple[nn.Module, list[str]]:
    torch.manual_seed(seed)
    return build_model(cfg, info)


def load_run_model(run_dir: str | Path, weights: str | Path | None = None,
                   device: torch.device | str = "cpu") -> tuple[nn.Module, RunConfig]:
    """Rebuild the model a run directory holds: supernet from the saved config, then
    ``dms.apply_structure`` with ``structure.json`` (when the run found one), then the
    safetensors weights (``model.safetensors`` unless ``weights`` is given).

    Raises:
        ConfigError: not a run directory, or its files do not fit together.
    """
    rd = RunDir(run_dir)
    cfg = load_run_config(rd.path)
    with torch.random.fork_rng(devices=[]):
        model, _ = _new_supernet(cfg, cfg.task_info, cfg.seed)
    wpath = Path(weights) if weights is not None else rd / "model.safetensors"
    if wpath.name != "supernet.safetensors" and (rd / "structure.json").is_file():
        structure = json.loads((rd / "structure.json").read_text(encoding="utf-8"))
        try:
            dms.apply_structure(model, structure)
        except dms.StructureError as err:
            raise ConfigError(f"{rd / 'structure.json'}: {err}") from None
    if not wpath.is_file():
        state = rd.read_json("state.json", {})
        hint = " (the run is unfinished: continue it with --resume, or use `dmscale export`)" \
            if state.get("status") != "done" else ""
        raise ConfigError(f"{rd.path} has no {wpath.name}{hint}")
    load_weights(model, wpath)
    return model.to(device), cfg


def load_teacher(spec: str, device: torch.device, supernet: nn.Module | None = None,
                 copy_supernet: bool = True) -> nn.Module:
    """A frozen teacher from ``--teacher``: a run directory, a safetensors file inside one,
    a ``torch.save``'d module, or ``supernet`` (the given pretrained supernet: a frozen copy
    of it, or itself when ``copy_supernet`` is False)."""
    if spec == "supernet":
        if supernet is None:
            raise ConfigError("--teacher supernet: this run has no pretrained supernet")
        teacher = copy.deepcopy(supernet) if copy_supernet else supernet
    else:
        p = Path(spec)
        if p.is_dir():
            teacher, _ = load_run_model(p)
        elif p.suffix == ".safetensors" and (p.parent / "config.yaml").is_file():
            teacher, _ = load_run_model(p.parent, weights=p)
        elif p.is_file() and p.suffix in (".pt", ".pth"):
            try:
                teacher = torch.load(p, map_location="cpu", weights_only=False)
            except Exception as err:  # noqa: BLE001 - any unpickling error is the user's file
                raise ConfigError(f"--teacher {p}: cannot load: {err}") from None
            if not isinstance(teacher, nn.Module):
                raise ConfigError(f"--teacher {p}: expected a saved nn.Module, got {type(teacher).__name__}")
        else:
            raise ConfigError(f"--teacher {spec}: expected a run directory, a model.safetensors "
                              "in one, a .pt module or 'supernet'")
    teacher.to(device).eval()
    for prm in teacher.parameters():
        prm.requires_grad_(False)
    return teacher


# ----------------------------------------------------------------------------- progress
class Progress:
    """A tqdm bar on a terminal; otherwise a log line every 10 % of the phase."""

    def __init__(self, phase: str, total: int, initial: int, quiet: bool) -> None:
        self.phase, self.total, self.quiet = phase, total, quiet
        self.tty = sys.stderr.isatty()
        self.start, self.initial = time.time(), initial
        self.next_line = initial + max(1, total // 10)
        self.bar = None
        self.text = ""
        if not quiet and self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=f"{phase:>8}", unit="step",
                            dynamic_ncols=True, leave=True, file=sys.stderr)

    def update(self, step: int, text: str) -> None:
        self.text = text
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(step - self.bar.n)
        elif not self.quiet and (step >= self.next_line or step == self.total):
            self.next_line = step + max(1, self.total // 10)
            rate = (time.time() - self.start) / max(1, step - self.initial)
            eta = rate * (self.total - step)
            print(f"{self.phase:>8} {step}/{self.total} | {text} | ETA {_fmt_time(eta)}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fmt_time(seconds: float) -> str:
    seconds = int(round(seconds))
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def fmt_count(value: float) -> str:
    """12_345_678 -> '12.35M'."""
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= div:
            return f"{value / div:.2f}{unit}"
    return f"{value:.0f}"


# ----------------------------------------------------------------------------- pipeline
def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load a run's checkpoint; a corrupt, truncated or foreign file is a :class:`ConfigError`
    that says how to go on (the run's other files stay as they are)."""
    fix = (f"delete {path} to restart the run from its beginning, or start a new run with "
           "another --out")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises many types for a damaged zip or pickle
        first = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError(f"{path} is corrupt or truncated ({type(err).__name__}: {first[:120]}); "
                          f"{fix}") from None
    if not isinstance(ckpt, dict) or ckpt.get("version") != CHECKPOINT_VERSION:
        got = ckpt.get("version") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ConfigError(f"{path}: expected a dmscale checkpoint of version {CHECKPOINT_VERSION}, "
                          f"got version {got!r}; resume it with the dmscale version that wrote it, or {fix}")
    return ckpt


class Pipeline:
    """Run (or resume) the phases of ``cfg`` in its run directory.

    Args:
        cfg: the run configuration (``out`` must be set: the run directory).
        resume: continue the run found in ``cfg.out``.
    """

    def __init__(self, cfg: RunConfig, resume: bool = False, explicit: set[str] | None = None) -> None:
        if cfg.out is None:
            raise ConfigError("the run needs a directory (--out)")
        self.rd = RunDir(cfg.out)
        self.resume = resume
        self._explicit = explicit
        self.cfg = self._prepare_config(cfg.resolved())
        self.device = resolve_device(self.cfg.device)
        self.threads = set_threads(self.cfg.threads)
        self.phases = phases_of(self.cfg)
        self.task: Task = build_task(self.cfg)
        if not self.cfg.task_info:
            self.cfg.task_info = dict(self.task.info)
        self.example = self.task.example_inputs().to(self.device)
        self.state = self.rd.read_json("state.json") if resume else None
        if self.state is None:
            self.state = {"phases": self.phases, "done": [], "global_step": 0, "status": "running",
                          "elapsed": 0.0, "counts": {}, "evals": {}, "warnings": []}
        self.global_step = int(self.state["global_step"])
        self._t0 = time.time()
        self._elapsed0 = float(self.state.get("elapsed", 0.0))

    # ------------------------------------------------------------------ setup
    def _prepare_config(self, cfg: RunConfig) -> RunConfig:
        path = self.rd.path
        if self.resume:
            saved = load_run_config(path)
            if saved.command != cfg.command:
                raise ConfigError(f"{path} is a `dmscale {saved.command}` run, not `{cfg.command}`")
            changed = {}
            for opt in OPTIONS_BY_NAME.values():
                new = getattr(cfg, opt.name)
                if opt.name in RESUME_MUTABLE or new == getattr(saved, opt.name):
                    continue
                if self._explicit is not None and opt.name not in self._explicit:
                    continue
                changed[opt.name] = (getattr(saved, opt.name), new)
            if changed:
                items = ", ".join(f"{OPTIONS_BY_NAME[k].flag} (run: {a!r}, now: {b!r})"
                                  for k, (a, b) in changed.items())
                raise ConfigError(f"cannot change options when resuming {path}: {items}")
            keep = {k: getattr(cfg, k) for k in RESUME_MUTABLE if k != "out"}
            cfg = replace(saved, **keep, out=str(path))
            if not self.rd.checkpoint.exists() and not (path / "state.json").exists():
                raise ConfigError(f"{path} has no checkpoint to resume from")
            return cfg
        if (path / "config.yaml").exists():
            raise ConfigError(f"{path} already holds a run: continue it with --resume, or "
                              "choose another --out")
        self._created = not path.exists() or not any(path.iterdir())
        return cfg

    def _elapsed(self) -> float:
        return self._elapsed0 + time.time() - self._t0

    def _save_state(self, **updates: Any) -> None:
        self.state.update(updates)
        self.state["global_step"] = self.global_step
        self.state["elapsed"] = self._elapsed()
        self.rd.write_json("state.json", self.state)

    def _log(self, message: str) -> None:
        if not self.cfg.quiet:
            print(message, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ main
    def run(self) -> dict[str, Any]:
        """Run the remaining phases; returns the summary (also in ``summary.json``).

        A new run that fails on a bad option before its first step leaves no directory.
        """
        try:
            return self._run()
        except ConfigError:
            if not self.resume and getattr(self, "_created", False) and self.global_step == 0:
                shutil.rmtree(self.rd.path, ignore_errors=True)
            raise

    def _run(self) -> dict[str, Any]:
        self.rd.path.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.rd.config)
        if self.resume:
            self.rd_checkpoint = self._load_checkpoint()
        else:
            self.rd_checkpoint = None
            self.rd.truncate_metrics(0)
            self._save_state()
        self._log(f"dmscale {self.cfg.command}: {self.task.describe()}")
        self._log(f"run directory: {self.rd.path} ({self.device}"
                  + (f", {self.threads} CPU thread{'s' if self.threads > 1 else ''})" if self.device.type == "cpu" else ")"))
        for phase in self.phases:
            if phase in self.state["done"]:
                continue
            if self._checkpoint_for_any() is None:
                torch.manual_seed(self.cfg.seed * 10 + PHASE_SEED[phase])
            getattr(self, f"_phase_{phase}")()
            self.state["done"].append(phase)
            self._save_state(metrics_offset=self.rd.metrics_size())
            self.rd_checkpoint = None
            if self.rd.checkpoint.exists():
                self.rd.checkpoint.unlink()
        if hasattr(self.task, "save_artifacts") and (self.rd / "model.safetensors").is_file():
            self.state["artifacts"] = self.task.save_artifacts(load_run_model(self.rd.path)[0], self.rd.path)
        summary = self._summary()
        self._save_state(status="done")
        self.rd.write_json("summary.json", summary)
        from .report import write_report

        summary["report"] = str(write_report(self.rd.path))
        self.rd.write_json("summary.json", summary)
        return summary

    def _checkpoint_for_any(self) -> dict[str, Any] | None:
        return self.rd_checkpoint

    def _load_checkpoint(self) -> dict[str, Any] | None:
        if not self.rd.checkpoint.exists():
            self.rd.truncate_metrics(int(self.state.get("metrics_offset", 0)))
            return None
        ckpt = read_checkpoint(self.rd.checkpoint)
        self.global_step = int(ckpt["global_step"])
        self.rd.truncate_metrics(int(ckpt["metrics_offset"]))
        self.state = ckpt["state"]
        self._elapsed0 = float(self.state.get("elapsed", 0.0))
        return ckpt

    def _checkpoint_for(self, phase: str) -> dict[str, Any] | None:
        ck = self.rd_checkpoint
        return ck if ck is not None and ck["phase"] == phase else None

    # ------------------------------------------------------------------ optimisers
    def _weight_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        cfg = self.cfg
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, nesterov=True,
                                   weight_decay=cfg.weight_decay)
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def _schedule(self, opt: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LambdaLR:
        warm = max(1, int(round(self.cfg.warmup * total))) if self.cfg.warmup > 0 else 0

        def factor(step: int) -> float:
            w = min(1.0, (step + 1) / warm) if warm else 1.0
            return w * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(1, total)))

        return torch.optim.lr_scheduler.LambdaLR(opt, factor)

    def _steps(self, epochs: float) -> int:
        spe = self.task.steps_per_epoch(self.cfg.batch_size)
        return max(1, int(math.ceil(epochs * spe)))

    # ------------------------------------------------------------------ the loop
    def _train(self, phase: str, model: nn.Module, total: int,
               optimizers: list[torch.optim.Optimizer], schedulers: list[Any],
               searcher: dms.Searcher | None = None, teacher: nn.Module | None = None,
               until: Any = None) -> None:
        """Train ``model`` for ``total`` steps of ``phase``, resuming from a checkpoint."""
        cfg, task = self.cfg, self.task
        start = 0
        ck = self._checkpoint_for(phase)
        if ck is not None:
            model.load_state_dict(ck["model"])
            if searcher is not None:
                searcher.load_state_dict(ck["searcher"])
            for o, s in zip(optimizers, ck["optimizers"]):
                o.load_state_dict(s)
            for sch, s in zip(schedulers, ck["schedulers"]):
                sch.load_state_dict(s)
            _set_rng_state(ck["rng"])
            start = int(ck["step"])
        seed = cfg.seed * 10 + PHASE_SEED[phase]
        spe = task.steps_per_epoch(cfg.batch_size)
        log_every = max(1, total // 300)
        model.train()
        bar = Progress(phase, total, start, cfg.quiet)
        non_finite = 0  # consecutive steps whose loss was NaN or infinite (skipped)

        def checkpoint(step: int) -> None:
            self.state["elapsed"] = self._elapsed()
            self.state["global_step"] = self.global_step
            self.rd.save_checkpoint({
                "version": CHECKPOINT_VERSION, "phase": phase, "step": step,
                "global_step": self.global_step, "model": model.state_dict(),
                "searcher": searcher.state_dict() if searcher is not None else None,
                "optimizers": [o.state_dict() for o in optimizers],
                "schedulers": [s.state_dict() for s in schedulers],
                "rng": _rng_state(), "metrics_offset": self.rd.metrics_size(),
                "state": copy.deepcopy(self.state),
            })

        signals = _StopOnSignals().__enter__()  # SIGINT/SIGTERM: checkpoint, then stop
        try:
            for step in range(start, total):
                if signals.received is not None:
                    checkpoint(step)
                    self._save_state(status="stopped")
                    raise Stopped(self.rd.path, self.global_step, signal=signals.received)
                if cfg.stop_after is not None and self.global_step >= cfg.stop_after:
                    checkpoint(step)
                    self._save_state(status="stopped")
                    raise Stopped(self.rd.path, self.global_step)
                x, y = task.train_batch(step, cfg.batch_size, seed)
                x, y = x.to(self.device), y.to(self.device)
                logits = task.forward(model, x)
                task_loss = task.task_loss(logits, y)
                loss = task_loss
                record: dict[str, Any] = {}
                if teacher is not None and cfg.distill_weight > 0:
                    with torch.no_grad():
                        t_logits = task.forward(teacher, x)
                    kd = distill_loss(logits, t_logits, cfg.distill_temperature)
                    loss = loss + cfg.distill_weight * kd
                    record["distill_loss"] = float(kd.detach())
                if searcher is not None:
                    progress = step / total if phase == "search" else 1.0
                    if phase == "finish":
                        r_loss = _calibrated_resource_loss(searcher, cfg.resource_weight)
                    else:
                        r_loss = searcher.resource_loss(progress=progress)
                    loss = loss + r_loss
                    record["resource_loss"] = float(r_loss.detach())
                if not bool(torch.isfinite(loss.detach()).all()):
                    # skip the step: no backward, so neither weights, importance nor
                    # structural parameters see it; stop when it keeps happening
                    non_finite += 1
                    self.global_step += 1
                    self.rd.append_metrics({"phase": phase, "event": "non_finite_loss", "step": step + 1,
                                            "global_step": self.global_step, "loss": str(float(loss.detach()))})
                    if non_finite >= MAX_NON_FINITE_STEPS:
                        raise NonFiniteLossError(
                            f"the {phase} loss was not finite ({float(loss.detach())}) for {non_finite} steps "
                            f"in a row, up to step {step + 1}; those steps were skipped and changed nothing. "
                            "Start again with a lower --lr (or --structure-lr, --resource-weight), or check "
                            "the data for NaN or infinite values")
                    continue
                non_finite = 0
                for o in optimizers:
                    o.zero_grad(set_to_none=True)
                loss.backward()
                for o in optimizers:
                    o.step()
                for sch in schedulers:
                    sch.step()
                self.global_step += 1
                done = step + 1
                if done % log_every == 0 or done == total or step == start:
                    record.update(phase=phase, step=done, global_step=self.global_step,
                                  time=round(self._elapsed(), 2), loss=float(loss.detach()),
                                  task_loss=float(task_loss.detach()),
                                  train_acc=task.batch_metric(logits.detach(), y))
                    if optimizers and optimizers[0].param_groups:
                        record["lr"] = optimizers[0].param_groups[0]["lr"]
                    text = f"loss {float(task_loss.detach()):.3f}"
                    if searcher is not None:
                        res = searcher.resources()
                        record.update(cost_soft=res["soft"], cost_hard=res["hard"],
                                      cost_target=searcher.target_at(progress),
                                      cost_final=res["target"], cost_supernet=res["supernet"])
                        text += (f" | {res['resource']} {fmt_count(res['hard'])} "
                                 f"(target now {fmt_count(record['cost_target'])}, "
                                 f"final {fmt_count(res['target'])})")
                    self.rd.append_metrics(record)
                    bar.update(done, text)
                if done % spe == 0 and done < total and searcher is None:
                    self._evaluate(phase, model, searcher, done, limit=2000)
                if done % cfg.checkpoint_every == 0 and done < total:
                    checkpoint(done)
                if until is not None and until():
                    if bar.bar is not None:
                        bar.bar.total = done
                    break
        finally:
            signals.__exit__()
            bar.close()

    def _evaluate(self, phase: str, model: nn.Module, searcher: dms.Searcher | None, step: int,
                  limit: int | None = None) -> dict[str, float]:
        if searcher is not None:
            with searcher.hardened():
                metrics = self.task.evaluate(model, device=self.device, limit=limit)
        else:
            metrics = self.task.evaluate(model, device=self.device, limit=limit)
        self.rd.append_metrics({"phase": phase, "event": "eval", "step": step,
                                "global_step": self.global_step, **metrics})
        return metrics

    # ------------------------------------------------------------------ phases
    def _phase_pretrain(self) -> None:
        cfg = self.cfg
        model, _ = _new_supernet(cfg, self.task.info, cfg.seed)
        model.to(self.device)
        self._record_supernet(model)
        epochs = cfg.epochs if cfg.command == "pretrain" else cfg.pretrain_epochs
        total = self._steps(epochs)
        opt = self._weight_optimizer(list(model.parameters()))
        sch = self._schedule(opt, total)
        self._train("pretrain", model, total, [opt], [sch])
        metrics = self._evaluate("pretrain", model, None, total)
        self.state["evals"]["pretrain"] = metrics
        save_weights(model, self.rd / "supernet.safetensors")
        if cfg.command == "pretrain":
            save_weights(model, self.rd / "model.safetensors")
            self.state["counts"]["found"] = self.state["counts"]["supernet"]

    def _record_supernet(self, model: nn.Module) -> None:
        if "supernet" not in self.state["counts"]:
            c = dms.count(model, self.example)
            c["parameters_total"] = sum(p.numel() for p in model.parameters())
            self.state["counts"]["supernet"] = c

    def _pretrained_supernet(self) -> tuple[nn.Module, list[str]]:
        """The supernet with pretrained weights (pretrain phase output or --init), and the
        model's own exclusions."""
        cfg = self.cfg
        model, exclude = _new_supernet(cfg, self.task.info, cfg.seed)
        if cfg.init is None and "pretrain" not in self.phases:  # hf:PATH, pretrained as loaded
            return model, exclude
        if cfg.init is None:
            return load_weights(model, self.rd / "supernet.safetensors"), exclude
        p = Path(cfg.init)
        if p.is_dir():
            src = load_run_config(p)
            if src.command != "pretrain":
                raise ConfigError(f"--init {p}: expected a `dmscale pretrain` run, got a "
                                  f"`dmscale {src.command}` run")
            p = p / "model.safetensors"
        return load_weights(model, p), exclude

    def search_config(self, exclude: list[str]) -> dms.SearchConfig:
        """The library config of this run's search (a subclass may change it, e.g. the gate of
        the baselines in bench/gates.py)."""
        cfg = self.cfg
        return dms.SearchConfig(
            resource=cfg.resource, target=cfg.target, resource_weight=cfg.resource_weight,
            schedule=cfg.schedule, importance=cfg.importance, min_width=cfg.min_width,
            width_step=cfg.width_step, search_width=cfg.search_dims in ("both", "width"),
            search_depth=cfg.search_dims in ("both", "depth"), exclude=exclude,
            width_only_from=cfg.width_only_from, cost_forward=cfg.cost_forward,
            layer_uniform=cfg.layer_uniform)

    def _make_searcher(self, model: nn.Module, extra_exclude: list[str]) -> dms.Searcher:
        cfg = self.cfg
        exclude = _expand_patterns(model, cfg.exclude or []) + extra_exclude
        try:
            return dms.prepare(model, self.example, self.search_config(exclude))
        except ValueError as err:  # bad budget, nothing to search, unsupported layer ...
            raise ConfigError(str(err).splitlines()[0]) from None
        except ModuleNotFoundError as err:
            raise ConfigError(f"--resource {cfg.resource} is not available: {err}") from None

    def _phase_search(self) -> None:
        cfg = self.cfg
        pretrained = cfg.pipeline in ("p", "p-")
        if pretrained:
            model, extra_exclude = self._pretrained_supernet()
        else:
            model, extra_exclude = _new_supernet(cfg, self.task.info, cfg.seed)
        model.to(self.device)
        self._record_supernet(model)
        teacher = None
        if cfg.teacher and cfg.distill_weight > 0:
            teacher = load_teacher(cfg.teacher, self.device, supernet=model if pretrained else None)
            self._check_teacher(teacher, model)
            self._teacher = teacher  # kept for the retrain phase of this run: one frozen copy
        searcher = self._make_searcher(model, extra_exclude)
        s_opt = torch.optim.Adam(list(searcher.structure_parameters()), lr=cfg.structure_lr,
                                 weight_decay=0.0)
        total = self._steps(cfg.epochs)
        if cfg.pipeline == "p-":
            for prm in searcher.model_parameters():
                prm.requires_grad_(False)
            optimizers, schedulers = [s_opt], []
        else:
            w_opt = self._weight_optimizer(list(searcher.model_parameters()))
            optimizers, schedulers = [w_opt, s_opt], [self._schedule(w_opt, total)]
        if self._checkpoint_for("finish") is None:
            self._train("search", model, total, optimizers, schedulers, searcher, teacher)
        self._finish_search(model, searcher, teacher, s_opt)
        self.rd.write_json("structure.json", searcher.structure())
        small = searcher.export()
        recalibrate_batchnorm(small, self.task, cfg.batch_size, cfg.seed * 10 + 5, self.device)
        metrics = self._evaluate("search", small, None, total)
        self.state["evals"]["search"] = metrics
        self.state["evals"]["final"] = metrics
        save_weights(small, self.rd / "model.safetensors")
        if is_hf_model(cfg.model) and "retrain" not in self.phases:
            self._save_hf(small)
        self.state["counts"]["found"] = dms.count(small, self.example)
        self.state["resources"] = searcher.resources()
        if cfg.resource == "latency":
            fit = searcher.latency_fit()
            self.state["latency_fit"] = {k: fit[k] for k in ("fit_rmse_rel", "fit_rmse_rel_max",
                                                             "parts_rel_error", "calibration")}
            self._log(f"latency model: fit error {fit['fit_rmse_rel']:.1%} (pooled relative RMSE, "
                      f"worst layer {fit['fit_rmse_rel_max']:.1%}); the parts add up to the timed "
                      f"model within {fit['parts_rel_error']:+.1%}, calibration x{fit['calibration']:.3f}")

    def _check_teacher(self, teacher: nn.Module, model: nn.Module) -> None:
        with torch.no_grad():
            was = model.training
            model.eval()
            a = self.task.forward(model, self.example)
            model.train(was)
            b = self.task.forward(teacher, self.example)
        if a.shape != b.shape:
            raise ConfigError(f"--teacher {self.cfg.teacher}: its logits have shape {tuple(b.shape)}, "
                              f"the model's {tuple(a.shape)}")

    def _finish_search(self, model: nn.Module, searcher: dms.Searcher, teacher: nn.Module | None,
                       s_opt: torch.optim.Optimizer) -> None:
        """Structure-only steps at the final target until the hard cost is under it; then the
        budget solver when the cost is still over, or under ``BUDGET_FILL`` x target (a
        budget left unused is capacity the found model could have had)."""
        def under() -> bool:
            res = searcher.resources()
            return res["hard"] <= res["target"] * (1 + 1e-9)

        def filled() -> bool:
            res = searcher.resources()
            return res["hard"] >= BUDGET_FILL * res["target"]

        if self._checkpoint_for("finish") is None:
            self.state["resources_search_end"] = searcher.resources()
        if self._checkpoint_for("finish") is not None or not under():
            frozen = [p for p in searcher.model_parameters() if p.requires_grad]
            for prm in frozen:
                prm.requires_grad_(False)
            try:
                self._train("finish", model, FINISH_STEPS, [s_opt], [], searcher, teacher, until=under)
            finally:
                for prm in frozen:
                    prm.requires_grad_(True)
        if not under() or not filled():  # common shift of every ratio, then refill unit by unit
            searcher.meet_target()
        moved = posthoc_line(self.state.get("resources_search_end"), searcher.resources())
        if moved:
            self._log(moved)
        if not under():
            res = searcher.resources()
            self.state["warnings"].append(
                f"the found model costs {fmt_count(res['hard'])} {res['resource']}, over the target "
                f"{fmt_count(res['target'])}: raise --resource-weight or --structure-lr, or search longer")

    def _phase_retrain(self) -> None:
        cfg = self.cfg
        source = RunDir(cfg.source) if cfg.command == "retrain" else self.rd
        structure = source.read_json("structure.json")
        if structure is None:
            raise ConfigError(f"{source.path} has no structure.json: run `dmscale search` first")
        if cfg.command == "retrain" and not (self.rd / "structure.json").exists():
            self.rd.write_json("structure.json", structure)
        if cfg.retrain_init == "inherit":
            model, _ = load_run_model(source.path)
        else:
            model, _ = _new_supernet(cfg, self.task.info, cfg.seed * 7 + 1)
            dms.apply_structure(model, structure)
        model.to(self.device)
        if "supernet" not in self.state["counts"]:
            counts = (source.read_json("state.json") or {}).get("counts", {})
            if "supernet" in counts:
                self.state["counts"]["supernet"] = counts["supernet"]
            else:
                with torch.random.fork_rng(devices=[]):
                    self._record_supernet(_new_supernet(cfg, self.task.info, cfg.seed)[0])
        self.state["counts"]["found"] = dms.count(model, self.example)
        teacher = getattr(self, "_teacher", None)
        if cfg.teacher and cfg.distill_weight > 0 and teacher is None:
            sup = None
            if cfg.teacher == "supernet":
                sup = self._pretrained_supernet()[0] if cfg.command == "search" else None
            teacher = load_teacher(cfg.teacher, self.device, supernet=sup, copy_supernet=False)
            self._check_teacher(teacher, model)
        epochs = cfg.epochs if cfg.command == "retrain" else cfg.retrain_epochs
        total = self._steps(epochs)
        opt = self._weight_optimizer(list(model.parameters()))
        sch = self._schedule(opt, total)
        self._train("retrain", model, total, [opt], [sch], teacher=teacher)
        metrics = self._evaluate("retrain", model, None, total)
        self.state["evals"]["retrain"] = metrics
        self.state["evals"]["final"] = metrics
        save_weights(model, self.rd / "model.safetensors")
        if is_hf_model(cfg.model):
            self._save_hf(model)

    def _save_hf(self, model: nn.Module) -> None:
        """``RUN/hf``: the found model of an ``hf:`` run as a ``from_pretrained`` directory."""
        fmt = save_hf_dir(model, self.rd / HF_DIR, self.cfg.model,
                          tokenizer=getattr(self.task, "tokenizer", None))
        how = "from_pretrained" + (" (trust_remote_code=True)" if fmt == "per_layer" else "")
        self._log(f"saved {self.rd / HF_DIR}: Hugging Face {fmt} format with the tokenizer (loads with {how})")

    # ------------------------------------------------------------------ summary
    def _summary(self) -> dict[str, Any]:
        cfg, st = self.cfg, self.state
        structure = self.rd.read_json("structure.json")
        return {
            "command": cfg.command, "run_dir": str(self.rd.path), "pipeline": cfg.pipeline,
            "phases": self.phases, "task": self.task.describe(), "task_kind": self.task.kind,
            "model": cfg.model, "model_args": cfg.model_args, "expand": cfg.expand,
            "resource": cfg.resource, "target": cfg.target,
            "counts": st["counts"], "resources": st.get("resources"),
            "resources_search_end": st.get("resources_search_end"),
            "evals": st["evals"], "steps": self.global_step,
            "elapsed": round(self._elapsed(), 1), "warnings": st["warnings"],
            "structure": _structure_brief(structure) if structure else None,
        }


def _structure_brief(structure: dict[str, Any]) -> dict[str, Any]:
    return {
        "width": [(w["name"], w["size"], w["kept"]) for w in structure.get("width", [])],
        "depth": [(d["name"], len(d["blocks"]), len(d["kept"])) for d in structure.get("depth", [])],
    }


# ----------------------------------------------------------------------------- export / eval
def example_from_info(info: dict[str, Any]) -> torch.Tensor:
    """A zero input of the task's shape (batch of 1), built without loading any data."""
    if info.get("kind") == "language":
        return torch.zeros(1, int(info["seq_len"]), dtype=torch.long)
    return torch.zeros(1, int(info["in_channels"]), *[int(s) for s in info["image_size"]])


def check_inputs_from_info(info: dict[str, Any], seed: int = 0) -> torch.Tensor:
    """A random input of the task's shape (batch of 1) to check deployed files on: random
    pixels, or random token ids below the vocabulary size (zeros would check little)."""
    g = torch.Generator().manual_seed(seed)
    if info.get("kind") == "language":
        vocab = max(1, len(info.get("vocab") or [None]))
        return torch.randint(0, vocab, (1, int(info["seq_len"])), generator=g)
    return torch.randn(1, int(info["in_channels"]), *[int(s) for s in info["image_size"]], generator=g)


def searcher_from_checkpoint(run_dir: str | Path) -> tuple[nn.Module, dms.Searcher, RunConfig, int]:
    """The supernet and searcher of an unfinished search, restored from its checkpoint.

    Returns ``(model, searcher, cfg, step)``.
    """
    rd = RunDir(run_dir)
    cfg = load_run_config(rd.path)
    if not rd.checkpoint.exists():
        raise ConfigError(f"{rd.path} has no checkpoint")
    ck = read_checkpoint(rd.checkpoint)
    if ck.get("phase") not in ("search", "finish"):
        raise ConfigError(f"{rd.path}: the checkpoint is of phase {ck.get('phase')!r}, not of a search")
    with torch.random.fork_rng(devices=[]):
        model, exclude = _new_supernet(cfg, cfg.task_info, cfg.seed)
    example = example_from_info(cfg.task_info)
    pipe = Pipeline.__new__(Pipeline)  # only _make_searcher is needed: no data, no run setup
    pipe.cfg, pipe.example = cfg, example
    searcher = pipe._make_searcher(model, exclude)
    model.load_state_dict(ck["model"])
    searcher.load_state_dict(ck["searcher"])
    return model, searcher, cfg, int(ck["step"])


def export_run(run_dir: str | Path, out: str | Path, fmt: str = "safetensors") -> str:
    """Write the found model of a run (or of its unfinished search) to ``out``; returns a
    description of what was written."""
    import shutil

    rd, od = RunDir(run_dir), RunDir(out)
    cfg = load_run_config(rd.path)
    state = rd.read_json("state.json", {})
    structure = rd.read_json("structure.json")
    od.path.mkdir(parents=True, exist_ok=True)
    if structure is None and rd.checkpoint.exists() and cfg.command == "search":
        model, searcher, cfg, step = searcher_from_checkpoint(rd.path)
        structure = searcher.structure()
        small = searcher.export()
        origin = f"the structure reached at step {step} of the unfinished search"
    elif (rd / "model.safetensors").is_file():
        small, cfg = load_run_model(rd.path)
        origin = "the " + ("pretrained supernet" if structure is None else "found model")
        if state.get("status") != "done":
            origin += " (of an unfinished run)"
    else:
        raise ConfigError(f"{rd.path} has neither a found model nor a search checkpoint to export")
    small.eval()
    if fmt == "hf":  # a Hugging Face directory only (dmscale.hf_export)
        if is_hf_model(cfg.model):  # with the original tokenizer
            save_hf_dir(small, od.path, cfg.model)
        else:
            dms.save_pretrained(small, od.path)
        saved = json.loads((od / "dmscale.json").read_text())
        how = "from_pretrained" + (" (trust_remote_code=True)" if saved["format"] == "per_layer" else "")
        return f"exported {origin} as a Hugging Face {saved['format']} model to {od.path} (loads with {how})"
    if od.path.resolve() != rd.path.resolve():
        shutil.copyfile(rd.config, od.config)
        if structure is not None:
            od.write_json("structure.json", structure)
        save_weights(small, od / "model.safetensors")
    files = ["config.yaml", "model.safetensors"] + (["structure.json"] if structure is not None else [])
    notes = []
    if fmt == "pt":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            needed = save_pickled(small, od / "model.pt", allow_dmscale=True)
        files.append("model.pt")
        notes.append(f"  model.pt needs dmscale to load ({', '.join(needed)})" if needed
                     else "  model.pt loads with torch.load(..., weights_only=False), without dmscale")
    elif fmt in ("onnx", "pt2"):
        x = check_inputs_from_info(cfg.task_info)
        if fmt == "onnx":
            diff = check_onnx(to_onnx(small, x, od / "model.onnx", check=False), small, x)
        else:
            diff = check_pt2(to_pt2(small, x, od / "model.pt2", check=False), small, x)
        files.append(f"model.{fmt}")
        notes.append(f"  model.{fmt}: input shape {tuple(x.shape)} (static), checked against PyTorch "
                     f"on a random input: max |diff| {diff:.2g}")
    elif fmt != "safetensors":
        raise ConfigError(f"unknown export format {fmt!r}: expected safetensors, pt, hf, onnx or pt2")
    c = dms.count(small, example_from_info(cfg.task_info))
    return "\n".join([f"exported {origin}: {fmt_count(c['macs'])} MACs, {fmt_count(c['params'])} parameters",
                      f"  to {od.path}: {', '.join(files)}", *notes])


def evaluate_run(run_dir: str | Path, data: str | None = None, test_limit: int | None = None,
                 batch_size: int | None = None, device: str = "auto",
                 threads: int | None = None) -> tuple[dict[str, Any], str]:
    """Evaluate the model of a run on its task's test split; returns ``(metrics, text)``."""
    set_threads(threads)
    dev = resolve_device(device)
    model, cfg = load_run_model(run_dir, device=dev)
    cfg = replace(cfg, data=data if data is not None else cfg.data,
                  test_limit=test_limit if test_limit is not None else cfg.test_limit,
                  train_limit=None if cfg.task in ("shakespeare", "text") else 1)
    task = build_task(cfg)
    metrics = task.evaluate(model, batch_size=batch_size or 256, device=dev)
    counts = dms.count(model, task.example_inputs().to(dev))
    result = {"run": str(run_dir), **metrics, **counts}
    text = (f"{Path(run_dir)}: {task.format_metrics(metrics)} on {metrics['examples']:,} test "
            f"{dict(shakespeare='characters', text='tokens').get(cfg.task, 'examples')}\n"
            f"  {fmt_count(counts['macs'])} MACs, {fmt_count(counts['params'])} parameters "
            f"({cfg.model}{', found structure' if (Path(run_dir) / 'structure.json').is_file() else ''})")
    return result, text
