"""Deploy an exported model: ONNX, ``torch.export`` (.pt2) and a ``torch.save`` that loads
without dmscale.

- :func:`to_onnx` exports through ``torch.onnx.export(..., dynamo=True)`` and checks the file
  with onnxruntime against the PyTorch model on the example inputs.
- :func:`to_pt2` exports with ``torch.export.export``, saves with ``torch.export.save`` and
  checks that ``torch.export.load`` gives the same outputs. A .pt2 file needs torch only.
- :func:`dmscale_classes` lists the dmscale classes and functions a pickle of the model
  would reference, i.e. what makes ``torch.load`` of it need dmscale; :func:`save_pickled`
  refuses (or warns) when there are any.

The batch size is dynamic by default (``dynamic_batch=True``): every input tensor whose first
dim is the example's batch size gets one symbolic ``batch`` dim, the export runs on a batch of
at least 2 (an example batch of 1 would be specialised to 1), and the check runs the file at
the example's batch, at 1 and at 3. A model whose code fixes the batch size (``x.view(2, -1)``,
a branch on ``x.shape[0]``) cannot be exported so: it is exported for the example's batch
size only, with a warning naming the reason. Other dims (image size, sequence length) stay
static. ONNX needs the optional packages of the ``deploy`` extra
(``pip install dmscale[deploy]``): onnx, onnxscript and, for the check, onnxruntime.

Example:
    >>> import tempfile, os, torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    >>> d = tempfile.mkdtemp()
    >>> to_pt2(net, torch.randn(3, 4), os.path.join(d, "net.pt2")).name
    'net.pt2'
    >>> dmscale_classes(net)
    []
"""

from __future__ import annotations

import importlib.util
import inspect
import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from dmscale.trace.values import split_inputs
from dmscale.core.errors import ExportCheckError, MissingDependencyError, StandaloneError
from dmscale.core.modes import eval_mode

__all__ = ["to_onnx", "to_pt2", "check_onnx", "check_pt2", "dmscale_classes", "dmscale_modules",
           "save_pickled", "batch_is_dynamic", "with_batch", "DEPLOY_EXTRA", "CHECK_BATCHES"]

DEPLOY_EXTRA = "pip install dmscale[deploy]"
CHECK_BATCHES = (1, 3)  # besides the example's: the batch sizes a dynamic-batch file is checked at


def _require(*packages: str) -> None:
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise MissingDependencyError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; ONNX "
            f"export needs the deploy extra: {DEPLOY_EXTRA}")


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def _compare(ref: list[torch.Tensor], got: list[Any], atol: float, rtol: float, what: str) -> float:
    """Largest ``|got - ref|``; raises :class:`ExportCheckError` beyond ``atol + rtol * |ref|``."""
    if len(ref) != len(got):
        raise ExportCheckError(f"{what} returns {len(got)} tensors, the PyTorch model {len(ref)}")
    worst = 0.0
    for i, (r, g) in enumerate(zip(ref, got)):
        g = torch.as_tensor(np.asarray(g)) if not isinstance(g, torch.Tensor) else g
        r = r.detach().cpu()
        if tuple(g.shape) != tuple(r.shape):
            raise ExportCheckError(f"{what}: output {i} has shape {tuple(g.shape)}, the PyTorch "
                                   f"model's has {tuple(r.shape)}")
        if r.numel() == 0:
            continue
        r64, g64 = r.double(), g.double()
        diff = (g64 - r64).abs()
        bound = atol + rtol * r64.abs()
        worst = max(worst, float(diff.max()))
        if not bool((diff <= bound).all()):
            k = int((diff - bound).argmax())
            raise ExportCheckError(
                f"{what} differs from the PyTorch model: output {i} max |diff| "
                f"{float(diff.max()):.3g} (at a value {float(r64.flatten()[k]):.3g}), tolerance "
                f"atol={atol:g} + rtol={rtol:g} * |value|")
    return worst


def _reference(model: nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    with torch.no_grad(), eval_mode(model):
        return _tensor_leaves(model(*args, **kwargs))


def check_onnx(path: str | os.PathLike[str], model: nn.Module, example_inputs: Any,
               atol: float = 1e-4, rtol: float = 1e-4) -> float:
    """Run the ONNX file in onnxruntime on ``example_inputs`` and compare with ``model``;
    returns the largest absolute difference, raises :class:`ExportCheckError` beyond the
    tolerance."""
    _require("onnxruntime")
    import onnxruntime as ort

    args, kwargs = split_inputs(example_inputs)
    ref = _reference(model, args, kwargs)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = _tensor_leaves((args, kwargs))
    names = [i.name for i in sess.get_inputs()]
    if len(names) != len(inputs):
        raise ExportCheckError(f"the ONNX graph takes {len(names)} inputs, the example has {len(inputs)} tensors")
    got = sess.run(None, {n: t.detach().cpu().numpy() for n, t in zip(names, inputs)})
    return _compare(ref, got, atol, rtol, f"ONNX file {path} in onnxruntime")


# ----------------------------------------------------------------------------- dynamic batch
def _batch_of(args: tuple, kwargs: dict) -> int | None:
    leaves = [t for t in _tensor_leaves((args, kwargs)) if t.dim() >= 1]
    return int(leaves[0].shape[0]) if leaves else None


def with_batch(example_inputs: Any, n: int) -> Any:
    """``example_inputs`` with every batched tensor (first dim = the first tensor's) made ``n``
    rows long by cycling its rows; other values unchanged.

    Example:
        >>> with_batch((torch.arange(2.0), torch.zeros(5)), 3)[0]
        tensor([0., 1., 0.])
    """
    args, kwargs = split_inputs(example_inputs)
    batch = _batch_of(args, kwargs)

    def resize(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch:
            return t
        return t.index_select(0, torch.arange(n, device=t.device) % batch)

    if isinstance(example_inputs, torch.Tensor):
        return resize(example_inputs)
    return tree_map(resize, example_inputs if isinstance(example_inputs, dict) else tuple(example_inputs))


def _batch_spec(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """``dynamic_shapes`` for torch.export: dim 0 of every batched tensor is one ``batch`` Dim."""
    batch, dim = _batch_of(args, kwargs), torch.export.Dim("batch")
    if batch is None:
        return None
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    return {name: tree_map(lambda t: {0: dim} if isinstance(t, torch.Tensor) and t.dim() >= 1
                           and t.shape[0] == batch else None, value)
            for name, value in bound.arguments.items()}


def _dynamic_export(model: nn.Module, example_inputs: Any) -> Any:
    """An ExportedProgram with a dynamic batch size, or None (with a warning naming the
    reason) when the model fixes its batch size or has no batched input."""
    args, kwargs = split_inputs(example_inputs)
    spec = _batch_spec(model, args, kwargs)
    if spec is None:
        return None
    bargs, bkwargs = split_inputs(with_batch(example_inputs, max(2, _batch_of(args, kwargs) or 2)))
    try:  # on a batch of 2 or more: a batch of 1 would be specialised to 1
        with torch.no_grad(), eval_mode(model):
            return torch.export.export(model, bargs, kwargs=bkwargs or None, dynamic_shapes=spec, strict=False)
    except Exception as err:  # torch.export raises several types for a specialised dim
        lines = [line.strip(" -") for line in str(err).splitlines() if line.strip(" -")] or [""]
        reason = next((line for line in lines if "speciali" in line), lines[0]).split(". ")[0]
        warnings.warn(f"{type(model).__name__} cannot be exported with a dynamic batch size "
                      f"({type(err).__name__}: {reason[:300]}); exporting for batch {_batch_of(args, kwargs)} "
                      "only. Serve that batch size, remove the code that fixes it, or pass "
                      "dynamic_batch=False to silence this", stacklevel=3)
        return None


def _check_batches(check: Any, path: Path, model: nn.Module, example_inputs: Any, dynamic: bool,
                   atol: float, rtol: float) -> float:
    """Run ``check`` at the example's batch and, for a dynamic-batch file, at :data:`CHECK_BATCHES`."""
    worst = check(path, model, example_inputs, atol, rtol)
    if dynamic:
        own = _batch_of(*split_inputs(example_inputs))
        for n in CHECK_BATCHES:
            if n != own:
                worst = max(worst, check(path, model, with_batch(example_inputs, n), atol, rtol))
    return worst


def _rename_batch(onnx_path: Path, symbol: str) -> None:
    """Call the exporter's symbol for the batch dim ``batch`` in the ONNX file's shapes."""
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    g = proto.graph
    for info in list(g.input) + list(g.output) + list(g.value_info):
        for d in info.type.tensor_type.shape.dim:
            if d.dim_param == symbol:
                d.dim_param = "batch"
    onnx.save(proto, str(onnx_path))


def _batch_symbol(program: Any) -> str | None:
    names = set(program.graph_signature.user_inputs)
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() >= 1 and isinstance(val.shape[0], torch.SymInt):
                return str(val.shape[0])
    return None


def batch_is_dynamic(path: str | os.PathLike[str]) -> bool:
    """Whether the ONNX or .pt2 file at ``path`` takes any batch size (its first input's dim 0
    is symbolic)."""
    p = Path(path)
    if p.suffix == ".onnx":
        import onnx

        graph = onnx.load(str(p), load_external_data=False).graph
        dims = graph.input[0].type.tensor_type.shape.dim if len(graph.input) else []
        return bool(dims) and bool(dims[0].dim_param)
    return _batch_symbol(torch.export.load(str(p))) is not None


def to_onnx(model: nn.Module, example_inputs: Any, path: str | os.PathLike[str], check: bool = True,
            atol: float = 1e-4, rtol: float = 1e-4, opset: int | None = None,
            dynamic_batch: bool = True) -> Path:
    """Export ``model`` (in eval mode) to ONNX at ``path`` with ``torch.onnx.export(dynamo=True)``;
    with ``check``, run it in onnxruntime and compare with PyTorch (see :func:`check_onnx`) at
    the example's batch size and, when the batch is dynamic (see the module docs), at 1 and 3.

    Example (needs the deploy extra):
        >>> import tempfile, os, torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
        >>> p = to_onnx(net, torch.randn(1, 3, 6, 6), os.path.join(tempfile.mkdtemp(), "n.onnx"))  # doctest: +SKIP
        >>> p.suffix  # doctest: +SKIP
        '.onnx'
    """
    _require("onnx", "onnxscript", *(("onnxruntime",) if check else ()))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = {} if opset is None else {"opset_version": opset}
    exported = _dynamic_export(model, example_inputs) if dynamic_batch else None
    args, kwargs = split_inputs(example_inputs)
    with torch.no_grad(), eval_mode(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exported is not None:
            program = torch.onnx.export(exported, dynamo=True, verbose=False, optimize=True, **extra)
        else:
            program = torch.onnx.export(model, args, kwargs=kwargs or None, dynamo=True, verbose=False,
                                        optimize=True, **extra)
    program.save(str(out))
    symbol = _batch_symbol(exported) if exported is not None else None
    if symbol is not None:
        _rename_batch(out, symbol)
    if check:
        _check_batches(check_onnx, out, model, example_inputs, exported is not None, atol, rtol)
    return out


def check_pt2(path: str | os.PathLike[str], model: nn.Module, example_inputs: Any,
              atol: float = 1e-5, rtol: float = 1e-5) -> float:
    """Load a .pt2 with ``torch.export.load`` and compare its outputs with ``model``'s."""
    args, kwargs = split_inputs(example_inputs)
    ref = _reference(model, args, kwargs)
    loaded = torch.export.load(str(path)).module()
    with torch.no_grad():
        got = _tensor_leaves(loaded(*args, **kwargs))
    return _compare(ref, got, atol, rtol, f"pt2 file {path}")


def to_pt2(model: nn.Module, example_inputs: Any, path: str | os.PathLike[str], check: bool = True,
           atol: float = 1e-5, rtol: float = 1e-5, dynamic_batch: bool = True) -> Path:
    """``torch.export.export`` ``model`` (eval mode) on ``example_inputs`` and save it to
    ``path`` with ``torch.export.save``, with a dynamic batch size unless the model fixes it
    (see the module docs); with ``check``, load it back and compare outputs (at the example's
    batch size and, when dynamic, at 1 and 3)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    program = _dynamic_export(model, example_inputs) if dynamic_batch else None
    dynamic = program is not None
    if program is None:
        args, kwargs = split_inputs(example_inputs)
        with torch.no_grad(), eval_mode(model):
            program = torch.export.export(model, args, kwargs=kwargs or None, strict=False)
    tmp = out.with_name(out.stem + ".tmp.pt2")
    torch.export.save(program, str(tmp))
    os.replace(tmp, out)
    if check:
        _check_batches(check_pt2, out, model, example_inputs, dynamic, atol, rtol)
    return out


def _from_dmscale(obj: Any) -> str | None:
    target = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    module = getattr(target, "__module__", None) or ""
    if module == "dmscale" or module.startswith("dmscale."):
        return f"{module}.{getattr(target, '__qualname__', type(target).__name__)}"
    return None


class _Finder(pickle.Pickler):
    """Pickles into nothing and notes every dmscale class or function it meets (tensor
    storages are skipped, so this costs no copy of the weights)."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.found: set[str] = set()

    def persistent_id(self, obj: Any) -> str | None:
        if isinstance(obj, (torch.UntypedStorage, torch.storage.TypedStorage)):
            return "storage"
        return None

    def reducer_override(self, obj: Any) -> Any:
        name = _from_dmscale(obj)
        if name is not None:
            self.found.add(name)
        return NotImplemented


def dmscale_classes(model: Any) -> list[str]:
    """The dmscale classes and functions a pickle of ``model`` (``torch.save``) references,
    sorted: empty when it loads where dmscale is not installed.

    Example:
        >>> from torch import nn
        >>> from dmscale.export.shrink import SkipBlock
        >>> dmscale_classes(nn.Sequential(nn.Linear(2, 2), SkipBlock()))
        ['dmscale.export.SkipBlock']
    """
    finder = _Finder()
    finder.dump(model)
    return sorted(finder.found)


def dmscale_modules(model: nn.Module) -> dict[str, str]:
    """``{submodule name: dmscale class}`` for the submodules whose class is dmscale's."""
    return {name or "<model>": found for name, m in model.named_modules()
            if (found := _from_dmscale(m)) is not None}


def save_pickled(model: nn.Module, path: str | os.PathLike[str], allow_dmscale: bool = False) -> list[str]:
    """``torch.save(model, path)`` after checking it loads without dmscale.

    When the model still needs dmscale classes (see :func:`dmscale_classes`), raises
    :class:`StandaloneError` naming them and where they sit, or with ``allow_dmscale`` saves
    anyway with a warning. Returns the dmscale classes the file needs.
    """
    needed = dmscale_classes(model)
    if needed:
        where = dmscale_modules(model)
        shown = ", ".join(f"{n} ({c.rpartition('.')[2]})" for n, c in list(where.items())[:6])
        msg = (f"the model references {', '.join(needed)}"
               + (f" at {shown}{' ...' if len(where) > 6 else ''}" if where else "")
               + ": torch.load of it needs dmscale installed. Use to_pt2/to_onnx (or "
               "safetensors + dmscale.load) for a file that does not")
        if not allow_dmscale:
            raise StandaloneError(msg)
        warnings.warn(msg, stacklevel=2)
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(model, tmp)
    os.replace(tmp, out)
    return needed
