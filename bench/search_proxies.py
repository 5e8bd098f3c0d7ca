"""What a DMS training step adds on a GPU, measured without one (issue 29): operators per step,
bytes saved for the backward pass, host synchronisations.

    PYTHONPATH=src:tests python -m bench.search_proxies [--models resnet50 vit_b16 llama_135m]
        [--baseline-src bench/_baseline/src]     # also "before": the package snapshot there

On a GPU a DMS step is launch-bound (thousands of tiny kernels) and memory-bound (masked
copies of activations kept for the backward pass); a CPU hides both. These proxies do not
depend on the device:

* **operators per step** (``torch.profiler``): the top-level ``aten::`` operators of one
  training step (forward, task loss, ``searcher.resource_loss``, backward, optimiser steps),
  each operator counted once however it is implemented inside (a ``_foreach`` call is one
  operator, as it is one multi-tensor launch on a GPU; Adam's ``item()`` reads of its CPU step
  counters are left out), DMS over plain;
* **bytes saved for the backward pass** (``torch.autograd.graph.saved_tensors_hooks``): the
  storages still held for the backward pass when the loss is computed (each storage once; the
  model's own parameters and buffers, which a masked weight ``W * m`` refers to, are held
  anyway and not counted),
  at the real batch size (the forward and task loss; the resource loss's graph is mask-sized
  and left out), traced under ``FakeTensorMode`` (shapes only: a ResNet-50 at batch
  64 costs nothing to trace), bf16 autocast as on a GPU, DMS over plain;
* **launching operators** (``--compiled``: also with the model under ``torch.compile(model)``,
  inductor's generated kernels profiled and counted one each): the operators above that run
  device work, views, casts to the dtype a tensor has and bare allocations left out;
* **host synchronisations**: ``aten::_local_scalar_dense`` calls (what ``.item()``,
  ``float(t)`` and ``bool(t)`` become) in the forward, losses and backward of a step outside
  the settle phase (the optimisers' step counters are CPU tensors, on a GPU too).

Both optimisers run with ``foreach=True``, as they do by default on a GPU.

The step is the README's: ``dms.prepare(model, example, SearchConfig(resource="macs",
target=0.5))`` (0.8 for the Llama), SGD on the model's parameters, Adam on the structural
ones, loss = task + ``resource_loss(0.5)``. With ``--baseline-src`` every model is measured
again in a subprocess whose ``PYTHONPATH`` is that snapshot (``python -m bench.gpu_check
--make-baseline COMMIT`` makes one) and the table shows before and after side by side.
Results: ``bench/results/search_proxies.{json,md}`` (cached per model and implementation, the md
rewritten after each row and at the end; ``--fresh`` re-measures); ``--fuse-norms`` adds rows of
the new code with its masked norms compiled (``SearchConfig(fuse_norms=True)``, the default on a
GPU); ``--compiled`` measures the compiled table (the "now" code only: the old code could not run
a compiled search). ``--quick``: the small models only, to ``bench/runs/search_proxies/``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.benchlib import RUNS, child_json, git_commit, load_cache, save_cache, snapshot_commit  # noqa: E402
from bench.lib.proxy_models import PROXY_MODELS, QUICK, ProxyModel, _call, _prepare, _step_fn  # noqa: E402
from bench.lib.proxy_table import render  # noqa: E402

RESULTS = ROOT / "bench" / "results"

__all__ = ["ProxyModel", "PROXY_MODELS", "top_level_operators", "launching_operators", "saved_bytes", "measure",
           "measure_compiled", "main"]


def _events(step: Callable[[], Any]) -> list[Any]:
    """The profiler's CPU events of one call of ``step``."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return list(prof.events())


def _top_events(events: list[Any], counted: Callable[[str], bool]) -> Iterator[Any]:
    """The ``counted`` events with no ``counted`` event among their callers."""
    for e in events:
        if not counted(e.name):
            continue
        parent = e.cpu_parent
        while parent is not None and not counted(parent.name):
            parent = parent.cpu_parent
        if parent is None:
            yield e


def _is_op(name: str) -> bool:
    return name.startswith("aten::")


def _count_top(events: list[Any]) -> Counter:
    counts: Counter = Counter(e.name for e in _top_events(events, _is_op))
    syncs = sum(e.name == "aten::_local_scalar_dense" for e in events)
    if syncs:
        counts["sync"] = syncs
    return counts


def top_level_operators(step: Callable[[], Any]) -> Counter:
    """``aten::`` operators of one call of ``step`` whose caller is no other ``aten::``
    operator (what Python and the autograd engine dispatch), plus, under the key
    ``"sync"``, every ``aten::_local_scalar_dense`` at any depth."""
    return _count_top(_events(step))


# allocations without a kernel (the memory is written by the op that fills it)
_ALLOCATIONS = {"aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
                "aten::empty_like", "aten::lift_fresh", "aten::resize_"}


def _is_tensor_type(t: Any) -> bool:
    """A schema type that is a Tensor, an optional one or a list of them."""
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch._C.ListType):
        t = t.getElementType()
    return isinstance(t, torch._C.TensorType)


def _returns_alias(name: str) -> bool:
    """Whether every overload of operator ``name`` that returns tensors returns views of an
    input (``Tensor(a)``, not written to): ``detach``, ``select``, ``view``, ``to`` without a
    copy ... (``slice`` and ``split`` also have list and string overloads, which do not count)."""
    packet = getattr(torch.ops.aten, name.split("::", 1)[1], None)
    overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
    tensor_returns = [[r for r in o._schema.returns if _is_tensor_type(r.type)] for o in overloads]
    tensor_returns = [rs for rs in tensor_returns if rs]
    return bool(tensor_returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for rs in tensor_returns for r in rs)


def _is_kernel(name: str) -> bool:
    return "cpp_fused" in name or "triton_" in name  # inductor's generated kernels (kernel profiling on)


def _launches(event: Any, memo: dict[int, bool]) -> bool:
    """Whether ``event`` runs device work: a generated kernel, an operator that is neither a
    view nor an allocation, or a view or allocation with such an operator below it (a
    ``reshape`` that copies, a cast that copies)."""
    key = id(event)
    if key not in memo:
        if _is_kernel(event.name) or (event.name not in _ALLOCATIONS and not _returns_alias(event.name)):
            memo[key] = True
        else:
            memo[key] = any(_launches(c, memo) for c in event.cpu_children if _is_op_or_kernel(c.name))
    return memo[key]


def _is_op_or_kernel(name: str) -> bool:
    return _is_op(name) or _is_kernel(name)


def _count_launching(events: list[Any]) -> Counter:
    memo: dict[int, bool] = {}
    return Counter("kernel" if _is_kernel(e.name) else e.name
                   for e in _top_events(events, _is_op_or_kernel) if _launches(e, memo))


def launching_operators(step: Callable[[], Any]) -> Counter:
    """The top-level operators of one call of ``step`` (as :func:`top_level_operators`) that
    run device work: views (``detach``, ``select``, ``reshape`` without a copy), casts to the
    dtype a tensor has and bare allocations are left out; an inductor-generated kernel counts
    as one operator (with ``torch._inductor.config.cpp.enable_kernel_profile``)."""
    return _count_launching(_events(step))


def saved_bytes(forward_loss: Callable[[], torch.Tensor], held_anyway: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the storages the autograd graph of ``forward_loss()`` holds for its backward
    pass when it returns (each storage once; tensors saved and freed on the way not counted;
    storages of ``held_anyway``, the model's parameters and buffers, not counted: the graph
    referring to a weight allocates nothing)."""
    skip = {t.untyped_storage()._cdata for t in held_anyway}
    refs: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        refs.append(weakref.ref(t))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward_loss()
    held: dict[int, int] = {}
    for ref in refs:
        t = ref()
        if t is not None:
            storage = t.untyped_storage()
            if storage._cdata not in skip:
                held[storage._cdata] = storage.nbytes()
    del loss
    return sum(held.values())


def _arms(spec: ProxyModel, fuse_norms: bool = False) -> tuple[Any, int, list[tuple[str, nn.Module, Any]]]:
    """The inputs of ``ops_batch``, the number of searched dims and the two arms: ("plain", a copy of the
    model, None) and ("dms", the model prepared for a search, its searcher)."""
    base = spec.build().train()
    plain, net = copy.deepcopy(base), base
    x = spec.inputs(spec.ops_batch)
    searcher = _prepare(spec, net, x, fuse_norms)
    dims = len(searcher.gates.width) + len(searcher.gates.depth)
    return x, dims, [("plain", plain, None), ("dms", net, searcher)]


def _profile_kernels() -> None:
    """Inductor's generated kernels appear in the profile (one event per kernel call)."""
    import torch._inductor.config as inductor_config
    inductor_config.cpp.enable_kernel_profile = True


def _operators(spec: ProxyModel, fuse_norms: bool = False) -> dict[str, Any]:
    x, dims, arms = _arms(spec, fuse_norms)
    out: dict[str, Any] = {"dims": dims}
    for label, model, s in arms:
        step = _step_fn(spec, model, x, s)
        step(), step()  # warm-up: optimiser state, importance exists
        events = _events(step)
        counts, launch = _count_top(events), _count_launching(events)
        # aten::item: Adam reads its CPU step counters (no device work, on a GPU neither)
        out[f"{label}_ops"] = sum(v for k, v in counts.items() if k not in ("sync", "aten::item"))
        # host synchronisations of the search itself: forward, loss and backward (Adam's
        # step counters live on the CPU and are read there, on a GPU too: not a device sync)
        out[f"{label}_sync"] = top_level_operators(lambda: step(optimise=False))["sync"]
        out[f"{label}_top"] = counts.most_common(8)
        out[f"{label}_launch"] = sum(v for k, v in launch.items() if k != "aten::item")
    out["ops_ratio"] = out["dms_ops"] / out["plain_ops"]
    out["launch_ratio"] = out["dms_launch"] / out["plain_launch"]
    return out


def measure_compiled(name: str) -> dict[str, Any]:
    """Operators that run device work per step (:func:`launching_operators`) with the model
    under ``torch.compile(model)`` (inductor, its kernels profiled), plain and with DMS: the
    forward and backward graphs become fused kernels; the gates' mask computation, the resource
    loss and the optimisers stay eager. A prepared model of the same class as a compiled plain
    one compiles again (the hook guard :func:`dmscale.prepare` switches on)."""
    _profile_kernels()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    spec = PROXY_MODELS[name]
    x, dims, arms = _arms(spec)
    out: dict[str, Any] = {"model": name, "shape": spec.shape, "dims": dims}
    for label, model, s in arms:
        step = _step_fn(spec, torch.compile(model), x, s)
        step(), step(), step()  # compiles; optimiser state, importance exist
        counts = launching_operators(step)
        out[f"{label}_launch"] = sum(v for k, v in counts.items() if k != "aten::item")
        out[f"{label}_kernels"] = counts["kernel"]
        out[f"{label}_top"] = counts.most_common(8)
    out["launch_ratio"] = out["dms_launch"] / out["plain_launch"]
    return out


def _saved(spec: ProxyModel) -> dict[str, Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    _, _, arms = _arms(spec)
    out = {}
    for label, model, s in arms:
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = spec.inputs(spec.batch)

            def forward_loss() -> torch.Tensor:  # (the resource loss's graph is mask-sized: left out)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return spec.loss(_call(model, x), x)
            out[f"{label}_bytes"] = saved_bytes(forward_loss, [*model.parameters(), *model.buffers()])
    out["bytes_ratio"] = out["dms_bytes"] / out["plain_bytes"]
    return out


def measure(name: str, fuse_norms: bool = False) -> dict[str, Any]:
    """Operators, host synchronisations and saved bytes of one model, plain and with DMS;
    ``fuse_norms``: the masked norms compiled (``SearchConfig(fuse_norms=True)``, inductor's
    kernels profiled and counted one each). The saved bytes are traced on fake tensors, where
    the norms run eagerly: compiled, they save the same tensors (measured on one norm)."""
    if fuse_norms:
        _profile_kernels()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    spec = PROXY_MODELS[name]
    return {"model": name, "shape": spec.shape, "target": spec.target, **_operators(spec, fuse_norms),
            **_saved(spec)}


# ---------------------------------------------------------------------------------- driver
def _in_subprocess(name: str, src: Path, compiled: bool = False, fuse_norms: bool = False) -> dict[str, Any]:
    flags = ["--child-compiled", name] if compiled else ["--child", name] + (["--child-fuse"] if fuse_norms else [])
    return child_json("bench.search_proxies", flags, [src, ROOT / "tests"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(PROXY_MODELS), default=None)
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="also measure the package snapshot in this src folder (before)")
    ap.add_argument("--compiled", action="store_true",
                    help="measure the step under torch.compile(model) instead (inductor; minutes per model)")
    ap.add_argument("--fuse-norms", action="store_true",
                    help="also the new code with SearchConfig(fuse_norms=True) (its masked norms compiled)")
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--quick", action="store_true", help=f"models {QUICK}, results under bench/runs/search_proxies")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-compiled", help=argparse.SUPPRESS)
    ap.add_argument("--child-fuse", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child or args.child_compiled:
        print(json.dumps(measure(args.child, args.child_fuse) if args.child else measure_compiled(args.child_compiled)))
        return
    out_dir = RUNS / "search_proxies" if args.quick else RESULTS  # --quick: nothing of bench/results is written
    out_dir.mkdir(parents=True, exist_ok=True)
    models = args.models or (QUICK if args.quick else list(PROXY_MODELS))
    path = out_dir / "search_proxies.json"
    cache = load_cache(path, {"rows": {}})
    command = "PYTHONPATH=src:tests python -m bench.search_proxies " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.compiled:  # the compiled table keeps its own command; the eager table's stays
        table = cache.setdefault("compiled", {"rows": {}})
        table["command"] = command
        impls = [(f"now ({git_commit(ROOT)})", ROOT / "src", False)]
    else:
        table = cache
        cache["command"] = command
        impls = [(f"now ({git_commit(ROOT)})", ROOT / "src", False)]
        if args.baseline_src is not None:
            impls.insert(0, (f"before ({snapshot_commit(args.baseline_src)})", args.baseline_src, False))
        if args.fuse_norms:
            impls.append((f"now, fused norms ({git_commit(ROOT)})", ROOT / "src", True))
    cache["machine"] = f"{platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    for name in models:
        for label, src, fuse in impls:
            key = f"{name}@{'fused' if fuse else label.split()[0]}"
            if key in table["rows"] and not args.fresh:
                continue
            row = _in_subprocess(name, src, compiled=args.compiled, fuse_norms=fuse)
            row["impl"] = label
            table["rows"][key] = row
            save_cache(path, cache, sort_keys=False)
            (out_dir / "search_proxies.md").write_text(render(cache))
            what = (f"launching {row['launch_ratio']:.2f}x" if args.compiled else
                    f"operators {row['ops_ratio']:.2f}x, launching {row['launch_ratio']:.2f}x, "
                    f"saved {row['bytes_ratio']:.3f}x, syncs {row['dms_sync']}")
            print(f"{name} {label}{' compiled' if args.compiled else ''}: {what}", flush=True)
    (out_dir / "search_proxies.md").write_text(render(cache))
    print(f"wrote {out_dir / 'search_proxies.md'}")


if __name__ == "__main__":
    main()
