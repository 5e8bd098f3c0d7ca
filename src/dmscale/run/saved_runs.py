"""Run directories as inputs: the model, teacher and searcher a run holds, its export and
its evaluation (``dmscale export`` / ``dmscale eval``).

Nothing here trains: :mod:`dmscale.run.pipeline` runs the phases that write these files.

Example:
    >>> import tempfile
    >>> from dmscale.config.run_config import RunConfig
    >>> from dmscale.run.pipeline import Pipeline
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     cfg = RunConfig(command="pretrain", task="digits", train_limit=64, test_limit=32,
    ...                     model="smallcnn", model_args={"width": 4, "blocks": 1},
    ...                     batch_size=32, quiet=True, out=tmp + "/run")
    ...     _ = Pipeline(cfg).run()
    ...     model, saved = load_run_model(tmp + "/run")
    ...     text = export_run(tmp + "/run", tmp + "/export")
    >>> type(model).__name__, saved.command, text.startswith("exported the pretrained supernet")
    ('SmallCNN', 'pretrain', True)
"""

from __future__ import annotations

import copy
import fnmatch
import json
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import dmscale as dms

from dmscale.export import files as _io
from dmscale.config.run_config import ConfigError, RunConfig, load_run_config
from dmscale.export.deploy import batch_is_dynamic, check_onnx, check_pt2, save_pickled, to_onnx, to_pt2
from dmscale.engine.device import resolve_device, set_threads
from dmscale.engine.rundir import RunDir, fmt_count, read_checkpoint
from dmscale.export.files import save_weights
from dmscale.export.hf_sizes import scaled_embeddings
from dmscale.tasks.hf_model import GGUF_FILE, gguf_pinned_depth, is_hf_model, save_gguf_file, save_hf_dir
from dmscale.tasks.registry import build_model, build_task

__all__ = [
    "check_inputs_from_info",
    "evaluate_run",
    "example_from_info",
    "export_run",
    "load_run_model",
    "load_teacher",
    "load_weights",
    "make_searcher",
    "search_config",
    "new_supernet",
    "searcher_from_checkpoint",
]


def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """:func:`dmscale.export.files.load_weights` with its errors as :class:`ConfigError` (one line)."""
    try:
        return _io.load_weights(model, path)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(str(err)) from None



def _expand_patterns(model: nn.Module, patterns: list[str], flag: str = "--exclude") -> list[str]:
    names = [n for n, _ in model.named_modules() if n]
    out: list[str] = []
    for pat in patterns:
        if any(ch in pat for ch in "*?["):
            hits = [n for n in names if fnmatch.fnmatchcase(n, pat)]
        else:
            hits = [pat] if any(n == pat or n.startswith(pat + ".") for n in names) else []
        if not hits:
            examples = ", ".join(names[:3])
            raise ConfigError(f"{flag} {pat!r} matches no module of the model "
                              f"(its module names look like: {examples})")
        out.extend(hits)
    return out


# ----------------------------------------------------------------------------- models
def new_supernet(cfg: RunConfig, info: dict[str, Any], seed: int) -> tuple[nn.Module, list[str]]:
    """The supernet of ``cfg`` initialised from ``seed``, and the model's own exclusions
    (random weights: ``--weights`` / ``--pretrained`` are loaded by the phase that starts)."""
    torch.manual_seed(seed)
    return build_model(cfg, info)


def _rebuilt_supernet(rd: RunDir, cfg: RunConfig) -> tuple[nn.Module, list[str]]:
    """:func:`new_supernet` of a saved run; a failure names the run (e.g. the module of a
    ``--model module:factory`` that is not importable here)."""
    try:
        with torch.random.fork_rng(devices=[]):
            return new_supernet(cfg, cfg.task_info, cfg.seed)
    except ConfigError as err:
        raise ConfigError(f"cannot rebuild the model of {rd.path} from its config.yaml: {err}") from None


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
    model, _ = _rebuilt_supernet(rd, cfg)
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
            raise ConfigError("--teacher supernet: this run has no pretrained supernet (it searched a "
                              "random one, or one pretrained in another run): give that run or "
                              "a model file as --teacher")
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


def search_config(cfg: RunConfig, exclude: list[str]) -> dms.SearchConfig:
    """The library :class:`~dmscale.SearchConfig` of the run configuration ``cfg``
    (:meth:`RunConfig.search_config`: every option SearchConfig declares, by name)."""
    return cfg.search_config(exclude)


def make_searcher(cfg: RunConfig, model: nn.Module, example: Any, extra_exclude: list[str],
                  configure: Callable[[list[str]], dms.SearchConfig] | None = None) -> dms.Searcher:
    """``dms.prepare`` of ``model`` with the search options of ``cfg`` (or ``configure(exclude)``,
    e.g. a baseline's gate); its errors as :class:`ConfigError` (one line). ``--keep-depth``
    patterns become module names; an ``hf:`` search with ``--export gguf`` keeps what llama.cpp
    needs too (:func:`gguf_pinned_depth`)."""
    exclude = _expand_patterns(model, cfg.exclude or []) + extra_exclude
    if is_hf_model(cfg.model) and cfg.layer_uniform:  # the standard config (and GGUF) states its scale
        exclude += [n for n in scaled_embeddings(model) if n not in exclude]
    try:
        scfg = configure(exclude) if configure is not None else search_config(cfg, exclude)
        pinned = gguf_pinned_depth(model, cfg.export, cfg.depth_unit) if is_hf_model(cfg.model) else []
        keep = list(dict.fromkeys(_expand_patterns(model, scfg.keep_depth, "--keep-depth") + pinned))
        scfg = replace(scfg, keep_depth=keep) if keep != scfg.keep_depth else scfg
        return dms.prepare(model, example, scfg)
    except ValueError as err:  # bad budget, nothing to search, unsupported layer ...
        raise ConfigError(str(err).splitlines()[0]) from None
    except ModuleNotFoundError as err:
        raise ConfigError(f"--resource {cfg.resource} is not available: {err}") from None


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
    model, exclude = _rebuilt_supernet(rd, cfg)
    searcher = make_searcher(cfg, model, example_from_info(cfg.task_info), exclude)
    model.load_state_dict(ck["model"])
    searcher.load_state_dict(ck["searcher"])
    return model, searcher, cfg, int(ck["step"])


def export_run(run_dir: str | Path, out: str | Path, fmt: str = "safetensors", gguf_type: str = "f16") -> str:
    """Write the found model of a run (or of its unfinished search) to ``out``; returns a
    description of what was written (``fmt="gguf"``: ``out/model.gguf``, or ``out`` itself
    when it ends in ``.gguf``, for llama.cpp, with ``gguf_type`` weights)."""
    import shutil

    rd, od = RunDir(run_dir), RunDir(out)
    cfg = load_run_config(rd.path)
    state = rd.read_json("state.json", {})
    structure = rd.read_json("structure.json")
    if structure is None and rd.checkpoint.exists() and cfg.command == "search":
        model, searcher, cfg, step = searcher_from_checkpoint(rd.path)
        if not searcher.has_importance():  # stopped before its first search step
            raise ConfigError(
                f"{rd.path}: the search stopped at step {step}, before any step updated importance "
                "(no search step with a finite task loss yet), so it has found no structure yet "
                "(an export would keep the first channels of every layer): continue it with "
                f"`dmscale search --resume {rd.path}`, then export")
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
    if fmt == "gguf":
        return _export_gguf(small, cfg, Path(out), origin, gguf_type)
    od.path.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":  # a Hugging Face directory only (dmscale.export.hf)
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
        shape = "dynamic batch" if batch_is_dynamic(od / f"model.{fmt}") else "static"
        notes.append(f"  model.{fmt}: input shape {tuple(x.shape)} ({shape}), checked against PyTorch "
                     f"on a random input: max |diff| {diff:.2g}")
    elif fmt != "safetensors":
        raise ConfigError(f"unknown export format {fmt!r}: expected safetensors, pt, hf, gguf, onnx or pt2")
    c = dms.count(small, example_from_info(cfg.task_info))
    return "\n".join([f"exported {origin}: {fmt_count(c['macs'])} MACs, {fmt_count(c['params'])} parameters",
                      f"  to {od.path}: {', '.join(files)}", *notes])


def _export_gguf(small: nn.Module, cfg: RunConfig, out: Path, origin: str, gguf_type: str) -> str:
    """``dmscale export --format gguf``: the found causal LM as one GGUF file for llama.cpp."""
    from dmscale.export.gguf import gguf_architecture

    path = out if out.suffix.lower() == ".gguf" else out / GGUF_FILE
    if is_hf_model(cfg.model):  # the source's tokenizer (copied verbatim from a .gguf source)
        save_gguf_file(small, path, cfg.model, gguf_type)
    else:
        dms.save_gguf(small, path, gguf_type=gguf_type)
    return (f"exported {origin} as GGUF ({gguf_architecture(small)}, {gguf_type}) to {path} "
            f"(llama.cpp: llama-cli -m {path}; Ollama: a Modelfile with FROM {path})")


def evaluate_run(run_dir: str | Path, data: str | None = None, test_limit: int | None = None,
                 batch_size: int | None = None, device: str = "auto",
                 threads: int | None = None, text_field: str | None = None,
                 workers: int | None = None, val_data: str | None = None) -> tuple[dict[str, Any], str]:
    """Evaluate the model of a run on its task's test split; returns ``(metrics, text)``
    (``workers``: image-folder loader processes, default: the machine's; ``val_data``: the
    held-out images of an image-folder run, default: the run's)."""
    set_threads(threads)
    dev = resolve_device(device)
    model, cfg = load_run_model(run_dir, device=dev)
    cfg = replace(cfg, data=data if data is not None else cfg.data, workers=workers,
                  val_data=val_data if val_data is not None else cfg.val_data,
                  text_field=text_field if text_field is not None else cfg.text_field,
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
