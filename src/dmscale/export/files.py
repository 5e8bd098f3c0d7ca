"""Save a pruned model as safetensors weights plus its structure, and load it back.

The directory holds ``structure.json`` (what :func:`dmscale.apply_structure` needs) and
``model.safetensors`` (tied weights stored once). Loading rebuilds the shapes on a model
built from the *original* architecture (e.g. the same Hugging Face config) and then loads
the weights strictly. Files are written to a temporary name and renamed, so an interrupted
save never leaves a half-written file.

Example:
    >>> import tempfile, torch
    >>> from torch import nn
    >>> import dmscale as dms
    >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> searcher = dms.prepare(net, torch.randn(1, 8), dms.SearchConfig(resource="params", target=0.5))
    >>> net(torch.randn(4, 8)).pow(2).mean().backward()  # a task-loss step: importance (Eq. 4)
    >>> _ = searcher.meet_target()
    >>> small, structure = searcher.export(), searcher.structure()
    >>> d = tempfile.mkdtemp()
    >>> dms.save(small, structure, d)
    >>> again = dms.load(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), d)
    >>> torch.equal(again[0].weight, small[0].weight)
    True
    >>> check_weights_fit(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), structure,
    ...                   d + "/model.safetensors")  # silent: the file fits
"""

from __future__ import annotations

import copy
import itertools
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dmscale.core.errors import MissingFileError, StructureError
from dmscale.export.shrink import apply_structure
from dmscale.trace.handlers.norms import share_formula

__all__ = ["save", "load", "save_weights", "load_weights", "check_weights_fit", "read_state_dict",
           "load_state_checked", "STRUCTURE_FILE", "WEIGHTS_FILE", "CHECKPOINT_KEYS", "WRAPPER_PREFIXES"]

STRUCTURE_FILE = "structure.json"
WEIGHTS_FILE = "model.safetensors"


def save_weights(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write ``model``'s weights as safetensors, atomically (tied tensors stored once)."""
    from safetensors.torch import save_model

    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    save_model(model, str(tmp), force_contiguous=True)
    os.replace(tmp, p)


def load_weights(model: nn.Module, path: str | os.PathLike[str]) -> nn.Module:
    """Load safetensors weights into ``model`` (strict); a clear error when they do not fit."""
    from safetensors.torch import load_model

    p = Path(path)
    if not p.is_file():
        raise MissingFileError(f"no weights file {p}: expected model.safetensors written by dmscale.save")
    try:
        load_model(model, str(p), strict=True)
    except RuntimeError as err:
        lines = str(err).strip().splitlines()
        raise StructureError(f"weights in {p} do not fit the model: "
                         f"{' '.join(s.strip() for s in lines[:3])[:300]}") from None
    return model


def save(model: nn.Module, structure: dict[str, Any], directory: str | os.PathLike[str]) -> None:
    """Write ``structure.json`` and ``model.safetensors`` of an exported model."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (STRUCTURE_FILE + ".tmp")
    tmp.write_text(json.dumps(structure, indent=1))
    os.replace(tmp, out / STRUCTURE_FILE)
    save_weights(model, out / WEIGHTS_FILE)


def load(model: nn.Module, directory: str | os.PathLike[str]) -> nn.Module:
    """Shrink ``model`` (built like the original supernet) to the saved structure and load
    the saved weights; returns ``model``."""
    src = Path(directory)
    for name in (STRUCTURE_FILE, WEIGHTS_FILE):
        if not (src / name).is_file():
            raise MissingFileError(f"{src / name} is missing: expected a directory written by dmscale.save")
    try:
        structure = json.loads((src / STRUCTURE_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise StructureError(f"{src / STRUCTURE_FILE} is not valid JSON ({err}): save the model "
                             "again with dmscale.save") from None
    check_weights_fit(model, structure, src / WEIGHTS_FILE)  # before anything changes
    apply_structure(model, structure)
    return load_weights(model, src / WEIGHTS_FILE)


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on the meta device (no
    weights are copied; tied parameters stay tied)."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    shadow = copy.deepcopy(model, memo)
    for original, twin in zip(model.modules(), shadow.modules()):
        share_formula(twin, original)  # norms are recognised by probing their real weights
    return shadow


def _expected_shapes(model: nn.Module) -> tuple[dict[str, list[int]], list[list[str]]]:
    """``{state_dict key: shape}`` and the groups of keys that name one tensor (tied)."""
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for key, t in state.items():
        groups.setdefault(id(t), []).append(key)
    return {k: list(t.shape) for k, t in state.items()}, list(groups.values())


def _file_shapes(path: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as err:  # safetensors raises its own error types for a damaged header
        raise StructureError(f"{path} is not a readable safetensors file ({type(err).__name__}: "
                             f"{str(err)[:200]}): save the model again with dmscale.save") from None


def _fit_problems(expected: dict[str, list[int]], groups: list[list[str]], stored: dict[str, list[int]],
                  model_name: str) -> list[str]:
    """What keeps ``stored`` (``{key: shape}`` of a file) from loading into a model with
    ``expected`` shapes (tied keys grouped): up to three phrases, each naming its first keys."""
    shapes = [f"{k!r} is {stored[k]} in the file, {shape} in {model_name}"
              for k, shape in expected.items() if k in stored and stored[k] != shape]
    missing = [g[0] for g in groups if not any(k in stored for k in g)]
    unexpected = [k for k in stored if k not in expected]
    return [f"{len(items)} tensor{'s' if len(items) > 1 else ''} {what} ({', '.join(map(str, items[:2]))}{', ...' if len(items) > 2 else ''})"
            for what, items in (("of another shape", shapes), ("missing from the file", [repr(k) for k in missing]),
                                ("in the file but not in the model", [repr(k) for k in unexpected])) if items]


# where a checkpoint dict keeps the model's weights (Lightning, most training scripts)
CHECKPOINT_KEYS = ("state_dict", "model", "model_state_dict")
# prefixes a wrapper adds to every key: DDP / DataParallel, a LightningModule's `model`
# attribute, torch.compile
WRAPPER_PREFIXES = ("module.", "model.", "_orig_mod.")


def _tensor_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of a weights file: a ``.safetensors`` file, or a ``torch.save``'d state dict
    or checkpoint dict holding one under ``"state_dict"``, ``"model"`` or ``"model_state_dict"``
    (read with ``weights_only=True``: no code in the file runs).

    Raises:
        MissingFileError: no such file.
        StructureError: the file cannot be read, or holds no state dict.

    Example:
        >>> import tempfile, torch
        >>> from torch import nn
        >>> path = tempfile.mkdtemp() + "/ckpt.pt"
        >>> torch.save({"epoch": 3, "state_dict": nn.Linear(2, 1).state_dict()}, path)
        >>> sorted(read_state_dict(path))
        ['bias', 'weight']
    """
    p = Path(path)
    if not p.is_file():
        raise MissingFileError(f"no weights file {p}" + (" (it is a directory)" if p.is_dir() else ""))
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(p))
        except Exception as err:  # safetensors raises its own error types for a damaged header
            raise StructureError(f"{p} is not a readable safetensors file ({type(err).__name__}: "
                                 f"{str(err)[:200]})") from None
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - not a torch file, or objects weights_only refuses
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        hint = ("it holds Python objects besides tensors (a pickled module or custom classes), which "
                "are not loaded: save the weights alone, torch.save(model.state_dict(), PATH)"
                if "weights_only" in str(err) or "Unsupported global" in str(err) else
                "expected a .safetensors file or a file written by torch.save")
        raise StructureError(f"{p} cannot be read as weights ({type(err).__name__}: {first}); {hint}") from None
    if _tensor_dict(obj):
        return dict(obj)
    if isinstance(obj, dict):
        for key in CHECKPOINT_KEYS:
            if _tensor_dict(obj.get(key)):
                return dict(obj[key])
        keys = ", ".join(repr(k) for k in list(obj)[:6])
        raise StructureError(f"{p} holds a dict without a state dict (keys {keys}): expected tensors by "
                             f"parameter name, or a checkpoint with one under {' / '.join(map(repr, CHECKPOINT_KEYS))}")
    raise StructureError(f"{p} holds a {type(obj).__name__}, not a state dict: save the weights with "
                         "torch.save(model.state_dict(), PATH) or safetensors")


def load_state_checked(model: nn.Module, state: dict[str, torch.Tensor], source: str,
                       model_name: str = "the model") -> nn.Module:
    """Load ``state`` into ``model`` when every key and shape fits (tied tensors may be stored
    once); else raise :class:`StructureError` naming the first keys missing, unexpected or of
    another shape (with both shapes). A prefix a wrapper put on every key of the file
    (:data:`WRAPPER_PREFIXES`: DDP's ``module.``, ...) and on none of the model's is dropped.

    Example:
        >>> from torch import nn
        >>> net = nn.Linear(2, 3)
        >>> _ = load_state_checked(net, {"module." + k: v for k, v in nn.Linear(2, 3).state_dict().items()}, "f")
        >>> try:
        ...     load_state_checked(net, nn.Linear(2, 4).state_dict(), "other.pt")
        ... except StructureError as err:
        ...     print(err)
        the weights in other.pt do not fit the model: 2 tensors of another shape ('weight' is [4, 2] in the file, [3, 2] in the model, 'bias' is [4] in the file, [3] in the model)
    """
    expected, groups = _expected_shapes(model)
    changed = True
    while changed and state:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in state) and not any(k.startswith(prefix) for k in expected):
                state = {k[len(prefix):]: v for k, v in state.items()}
                changed = True
    problems = _fit_problems(expected, groups, {k: list(v.shape) for k, v in state.items()}, model_name)
    if problems:
        raise StructureError(f"the weights in {source} do not fit {model_name}: {'; '.join(problems)}")
    model.load_state_dict(state, strict=False)  # every key checked above; a tied twin may be absent
    return model


def check_weights_fit(model: nn.Module, structure: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Raise :class:`StructureError` unless the weights file at ``path`` fits ``model`` once
    shrunk to ``structure``; ``model`` is not changed (the check shrinks a meta-device copy).
    The module's example shows it on a file that fits.
    """
    p = Path(path)
    if not p.is_file():
        raise MissingFileError(f"no weights file {p}: expected model.safetensors written by dmscale.save")
    shadow = _meta_copy(model)
    apply_structure(shadow, structure)
    expected, groups = _expected_shapes(shadow)
    stored = _file_shapes(p)
    problems = _fit_problems(expected, groups, stored, "the shrunk model")
    if problems:
        raise StructureError(f"the weights in {p} do not fit the model shrunk to its structure.json: "
                             f"{'; '.join(problems)}; load a directory written by dmscale.save "
                             "for this architecture (both files from the same save), onto a freshly built "
                             "model")
