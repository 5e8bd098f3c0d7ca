"""The measuring side of bench/gpu_check.py: one implementation of dmscale x one model, in a
fresh process whose PYTHONPATH holds that implementation's ``src`` only.

    PYTHONPATH=SRC python -m bench.lib.gpu_check_lib SPEC.json   # started by bench/gpu_check.py

``SPEC.json`` names the model, the tasks (``train``: table 1, ``export``: table 2), the device,
the quick flag, the step and round counts, the export configurations, a soft deadline (epoch
seconds: a task not yet started after it is skipped) and ``out``, the json file this process
rewrites after every measured arm, so a process killed half-way leaves what it measured.

Training step (``train``): the model in train mode, SGD (momentum 0.9) on the weights, one
step = forward under ``torch.autocast(device, bfloat16)``, the task loss, ``+
searcher.resource_loss(0.5)`` for DMS (outside autocast, as the README does it), backward,
``opt_w.step()`` and ``opt_s.step()`` (Adam, lr 0.01, on ``searcher.structure_parameters()``).
The plain arm runs first on the model as built, then the same model is prepared
(``dms.prepare(model, example, SearchConfig(resource="macs", target=T))``, on the device) and
the DMS arm runs. Each arm: warm-up steps, timed steps (synchronize + perf_counter), the peak
of ``torch.cuda.max_memory_allocated`` over its steps (reset before its first step; weights
included), and one profiled step: the CUDA kernels it launched (memcpy/memset counted apart)
or, on CPU, the ``aten::`` ops it ran (nested ones included).

Export latency (``export``): for each configuration, a copy of the original model is prepared,
``searcher.randomize_importance(0)``, ``searcher.meet_target()``, ``searcher.export()`` (on the
CPU by default: the structure does not depend on the device, the budget solver's exact-cost
loop is Python-bound); the original and every export are moved to the device, cast to
bfloat16, put in eval mode and timed interleaved round by round under
``torch.inference_mode()`` at each batch size.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["ModelSpec", "SPECS", "env_info", "resolve_configs", "compiled", "count_ops", "train_arm", "train_task", "export_task", "run_spec", "main"]

PROGRESS = 0.5  # resource_loss(progress): before the default settle phase (Eq. 6's loss on the soft cost)


# ----------------------------------------------------------------------------- models
def _resnet(quick: bool) -> nn.Module:
    import dmscale as dms

    dms.ensure_torchvision()
    import torchvision

    return torchvision.models.resnet18(num_classes=10) if quick else torchvision.models.resnet50()


def _vit(quick: bool) -> nn.Module:
    import dmscale as dms

    dms.ensure_torchvision()
    import timm

    if quick:
        return timm.create_model("vit_base_patch16_224", pretrained=False, img_size=32, depth=2,
                                 embed_dim=64, num_heads=4, num_classes=10)
    return timm.create_model("vit_base_patch16_224", pretrained=False)


def _llama(quick: bool) -> nn.Module:
    import dmscale as dms

    dms.ensure_torchvision()
    import transformers

    if quick:
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                       max_position_embeddings=64, tie_word_embeddings=True)
    else:  # SmolLM2-135M's shape, random init
        cfg = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                       num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                       max_position_embeddings=2048, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg)


def _yolo(quick: bool) -> nn.Module:
    from dmscale.integrations.ultralytics import build_yolo

    return build_yolo("yolov8n.yaml", nc=80)


def _images(size: int) -> Callable[[int, torch.device], torch.Tensor]:
    return lambda b, dev: torch.randn(b, 3, size, size, generator=torch.Generator().manual_seed(0)).to(dev)


def _tokens(seq: int, vocab: int) -> Callable[[int, torch.device], dict[str, torch.Tensor]]:
    def make(b: int, dev: torch.device) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (b, seq), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids.to(dev)}
    return make


def _ce(out: Any, x: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), torch.arange(out.shape[0], device=out.device) % 10)


def _next_token(out: Any, x: dict[str, torch.Tensor]) -> torch.Tensor:
    logits, ids = out.logits[:, :-1], x["input_ids"][:, 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids.reshape(-1))


@dataclass(frozen=True)
class ModelSpec:
    """One row of the tables: the model (full or ``quick``), its inputs, loss, MACs target,
    training batch and input description, each as ``(full, quick)``."""

    name: str
    build: Callable[[bool], nn.Module]
    inputs: tuple[Callable[[int, torch.device], Any], Callable[[int, torch.device], Any]]
    loss: Callable[[Any, Any], torch.Tensor] | None  # None: export latency only
    target: float
    batch: tuple[int, int]
    shape: tuple[str, str]
    needs: str = ""  # a module that must import, else the row is n/a

    def make_inputs(self, quick: bool, batch: int, device: torch.device) -> Any:
        return self.inputs[quick](batch, device)

    def train_batch(self, quick: bool) -> int:
        return self.batch[quick]

    def describe(self, quick: bool) -> str:
        return self.shape[quick]


SPECS: dict[str, ModelSpec] = {s.name: s for s in [
    ModelSpec("resnet50", _resnet, (_images(224), _images(32)), _ce, 0.5, (64, 2),
              ("torchvision resnet50, 3x224x224", "quick: resnet18, 3x32x32")),
    ModelSpec("vit_b16", _vit, (_images(224), _images(32)), _ce, 0.5, (64, 2),
              ("timm vit_base_patch16_224, 3x224x224", "quick: vit depth 2, d 64, 3x32x32")),
    ModelSpec("llama_135m", _llama, (_tokens(512, 49152), _tokens(16, 256)), _next_token, 0.8, (16, 2),
              ("Llama, SmolLM2-135M shape (30 layers, d 576, GQA 9/3), 512 tokens",
               "quick: Llama 2 layers, d 64, 16 tokens")),
    ModelSpec("yolov8n", _yolo, (_images(640), _images(64)), None, 0.5, (64, 2),
              ("ultralytics yolov8n, 3x640x640", "quick: yolov8n, 3x64x64"), needs="ultralytics"),
]}


def _example(x: Any) -> Any:
    """The first example of a batch (what ``dms.prepare`` traces)."""
    return {k: v[:1] for k, v in x.items()} if isinstance(x, dict) else x[:1]


def _call(model: nn.Module, x: Any) -> Any:
    return model(**x) if isinstance(x, dict) else model(x)


# ----------------------------------------------------------------------------- device helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds of one call, the device synchronised before and after."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return 1e3 * (time.perf_counter() - t0)


def _profiled(fn: Callable[[], Any], device: torch.device, activities: list[Any]) -> Any:
    from torch.profiler import profile

    _sync(device)
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    return prof.events()


def count_ops(fn: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """What one call of ``fn`` launched, from torch.profiler: CUDA kernels (and, apart,
    memcpy/memset) on a GPU, traced with the CUDA activity alone (few events to parse; with
    the CPU activity too if that finds none); ``aten::`` ops, nested ones included, on CPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    if device.type != "cuda":
        events = _profiled(fn, device, [ProfilerActivity.CPU])
        return {"kernels": sum(1 for e in events if e.name.startswith("aten::")), "counted": "CPU aten ops (nested)"}
    for activities in ([ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        dev = [e for e in _profiled(fn, device, activities) if e.device_type == DeviceType.CUDA]
        if dev:
            break
    mem = sum(1 for e in dev if e.name.startswith(("Memcpy", "Memset")))
    # the device's busy time in the step: against the wall time it says whether the step is bound
    # by the GPU or by the host (Python, dispatch, launches)
    busy_ms = sum(e.time_range.elapsed_us() for e in dev) / 1e3
    return {"kernels": len(dev) - mem, "memcpy_memset": mem, "counted": "CUDA kernels",
            "kernel_ms": busy_ms, "profiled": "+".join(a.name for a in activities)}


def env_info(device: torch.device) -> dict[str, Any]:
    """torch / CUDA / GPU, the versions of the model libraries, and which dmscale is imported."""
    import dmscale as dms

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "cuda": torch.version.cuda, "device": str(device),
                            "dmscale_file": dms.__file__,
                            "align_option": "align" in {f.name for f in dataclasses.fields(dms.SearchConfig)}}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_mem_gib=round(props.total_memory / 2 ** 30, 1),
                    capability=f"{props.major}.{props.minor}", cudnn=torch.backends.cudnn.version())
    for mod in ("timm", "transformers", "torchvision", "ultralytics"):
        if mod in sys.modules:
            info[mod] = getattr(sys.modules[mod], "__version__", "?")
    return info


# ----------------------------------------------------------------------------- table 1
def _train_step(net: nn.Module, x: Any, spec: ModelSpec, device: torch.device, opts: list[torch.optim.Optimizer],
                searcher: Any) -> None:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = spec.loss(_call(net, x), x)
    if searcher is not None:
        loss = loss + searcher.resource_loss(progress=PROGRESS)
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    loss.backward()
    for opt in opts:
        opt.step()


def _optimizers(model: nn.Module, searcher: Any) -> list[torch.optim.Optimizer]:
    """SGD on the weights (``searcher.model_parameters()`` for DMS), Adam on the structure."""
    if searcher is None:
        return [torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)]
    return [torch.optim.SGD(searcher.model_parameters(), lr=1e-3, momentum=0.9),
            torch.optim.Adam(searcher.structure_parameters(), lr=0.01)]


def compiled(model: nn.Module, how: str | None) -> nn.Module:
    """``model`` under torch.compile: ``"module"``: ``torch.compile(model)``
    (``"module_cudagraphs"``: with ``mode="reduce-overhead"``); ``"forward"``:
    ``model.forward = torch.compile(model.forward)``, as dmscale's own ``--compile`` does it
    (the forward pre-hooks, where the masks are computed, stay eager); None: as it is."""
    if how == "module":
        return torch.compile(model)
    if how == "module_cudagraphs":  # CUDA graphs replay the compiled graphs: the host launches one each
        return torch.compile(model, mode="reduce-overhead")
    if how == "forward":
        model.forward = torch.compile(model.forward)  # type: ignore[method-assign]
    return model


def train_arm(model: nn.Module, x: Any, spec: ModelSpec, device: torch.device, searcher: Any,
              steps: int, warmup: int, compile_how: str | None = None) -> dict[str, Any]:
    """Warm-up, timed steps, their memory peak and one profiled step of one arm."""
    net = compiled(model, compile_how)
    opts = _optimizers(model, searcher)
    step = lambda: _train_step(net, x, spec, device, opts, searcher)  # noqa: E731
    _reset_peak(device)
    first = _timed(step, device)  # includes torch.compile's compilation when compiled
    for _ in range(warmup - 1):
        step()
    times = [_timed(step, device) for _ in range(steps)]
    out = {"median_ms": statistics.median(times), "times_ms": [round(t, 3) for t in times],
           "first_ms": first, "peak_gib": _peak_gib(device)}
    try:  # the profiler (CUPTI on a GPU) failing must not lose the timings
        out.update(count_ops(step, device))
    except Exception as e:  # noqa: BLE001
        out["kernels_error"] = _error(e)
    model.zero_grad(set_to_none=True)
    if compile_how == "forward":
        del model.forward  # the class's forward again
    return out


def train_task(spec: ModelSpec, quick: bool, device: torch.device, out: dict[str, Any], save: Callable[[], None],
               steps: int, warmup: int, compile_how: str | None = None, batch: int | None = None,
               fuse_norms: bool | None = None, fold_batch: bool | None = None) -> None:
    """Table 1 for one model: the plain arm, ``dms.prepare`` on the device, the DMS arm;
    ``out`` is filled in place and saved after each arm. ``batch``: default the spec's;
    ``fold_batch=False``: the DMS arm folds layer by layer (``dmscale.core.fold_batch.ENABLED``)."""
    import dmscale as dms

    if fold_batch is not None:
        from dmscale.core import fold_batch as batch_module  # (ImportError: code from before the batch)
        batch_module.ENABLED = fold_batch

    torch.manual_seed(0)
    batch = batch or spec.train_batch(quick)
    model = spec.build(quick).to(device).train()
    x = spec.make_inputs(quick, batch, device)
    out.update(batch=batch, input=spec.describe(quick), compiled=compile_how,
               target=spec.target, progress=PROGRESS, fold_batch=fold_batch)
    out["plain"] = train_arm(model, x, spec, device, None, steps, warmup, compile_how)
    save()
    if compile_how:
        torch._dynamo.reset()
    _reset_peak(device)
    t0 = time.perf_counter()
    extra = {} if fuse_norms is None else {"fuse_norms": fuse_norms}  # (today's code has no such option)
    searcher = dms.prepare(model, _example(x), dms.SearchConfig(resource="macs", target=spec.target, **extra))
    _sync(device)
    out.update(prepare_s=time.perf_counter() - t0, prepare_peak_gib=_peak_gib(device),
               dims=len(searcher.gates.width) + len(searcher.gates.depth))
    model.train()
    out["dms"] = train_arm(model, x, spec, device, searcher, steps, warmup, compile_how)
    out["fused_norms"] = _fused_norms_state()
    save()


def _fused_norms_state() -> dict[str, Any] | None:
    """Whether the DMS arm ran its masked norms compiled (``SearchConfig(fuse_norms)``, auto on
    CUDA) and the compiler error that stopped it; None for code without the option."""
    try:
        from dmscale.core import fused_norms
    except ImportError:
        return None
    return fused_norms.fusion_state() or {"compiled": [], "failure": None}


# ----------------------------------------------------------------------------- table 2
def _structure_info(searcher: Any, small: nn.Module) -> dict[str, Any]:
    """MACs kept, widths that are multiples of 8, parameters and fused attention of an export."""
    res = searcher.resources()
    widths = searcher.structure()["width"]
    fused = [bool(m.fused_attn) for m in small.modules() if hasattr(m, "fused_attn")]
    return {"macs_ratio": res["hard"] / res["supernet"], "widths_mult8": sum(w["kept"] % 8 == 0 for w in widths),
            "widths": len(widths), "kept_widths": sorted({(w["size"], w["kept"]) for w in widths}),
            "params_m": sum(p.numel() for p in small.parameters()) / 1e6,
            "fused_attn": [sum(fused), len(fused)] if fused else None}


def export_one(original: nn.Module, example: Any, target: float, overrides: dict[str, Any]) -> tuple[nn.Module, dict]:
    """A copy of ``original`` prepared with ``overrides``, random importance, brought to the
    target by the budget solver and exported; the export and what it kept."""
    import dmscale as dms

    model = copy.deepcopy(original)
    t0 = time.perf_counter()
    searcher = dms.prepare(model, example, dms.SearchConfig(resource="macs", target=target, **overrides))
    t1 = time.perf_counter()
    searcher.randomize_importance(0)
    searcher.meet_target()
    t2 = time.perf_counter()
    small = searcher.export()
    info = {"prepare_s": t1 - t0, "meet_target_s": t2 - t1, "export_s": time.perf_counter() - t2,
            **_structure_info(searcher, small)}
    return small, info


def latency(nets: dict[str, nn.Module], x: Any, device: torch.device, rounds: int, warmup: int = 3
            ) -> dict[str, dict[str, float]]:
    """Median and quartiles (ms) of one forward of every net, interleaved round by round."""
    times: dict[str, list[float]] = {k: [] for k in nets}
    with torch.inference_mode():
        for r in range(warmup + rounds):
            for k, net in nets.items():
                t = _timed(lambda: _call(net, x), device)
                if r >= warmup:
                    times[k].append(t)
    out = {}
    for k, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3
        out[k] = {"median_ms": statistics.median(ts), "q1_ms": q[0], "q3_ms": q[2]}
    return out


def resolve_configs(configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any] | str]:
    """The export configurations this dmscale can run: where SearchConfig has no ``align``,
    ``align=1`` becomes the default configuration (marked with a ``note``) and any other
    alignment the reason it is n/a."""
    import dmscale as dms

    fields = {f.name for f in dataclasses.fields(dms.SearchConfig)}
    out: dict[str, dict[str, Any] | str] = {}
    for label, overrides in configs.items():
        if "align" in overrides and "align" not in fields:
            out[label] = ({k: v for k, v in overrides.items() if k != "align"} if overrides["align"] == 1
                          else "SearchConfig has no align option")
        else:
            out[label] = overrides
    return out


def _bf16(x: Any) -> Any:
    if isinstance(x, dict):
        return x
    return x.to(torch.bfloat16)


def export_task(spec: ModelSpec, quick: bool, device: torch.device, out: dict[str, Any], save: Callable[[], None],
                configs: dict[str, dict[str, Any]], rounds: int, deadline: float, batch: int | None = None,
                export_device: str = "cpu") -> None:
    """Table 2 for one model: one export per configuration (prepared, solved and exported on
    ``export_device``: the budget solver's ~1,500 exact-cost evaluations of a 30-layer model
    are Python-bound), then the latency of the original and of each export (bfloat16, eval, on
    ``device``) at the training batch (``batch``: default the spec's) and at batch 1."""
    torch.manual_seed(0)
    where = torch.device(export_device)
    original = spec.build(quick).to(where).eval()
    example = _example(spec.make_inputs(quick, 1, where))
    nets = {"original": original}
    out.update(target=spec.target, input=spec.describe(quick), exports={}, export_device=str(where))
    for label, overrides in resolve_configs(configs).items():
        if isinstance(overrides, str):
            out["exports"][label] = {"na": overrides}
            continue
        if time.time() > deadline:
            out["exports"][label] = {"skipped": "time budget spent before this export"}
            continue
        try:
            nets[label], out["exports"][label] = export_one(original, example, spec.target, overrides)
            if overrides != configs[label]:
                out["exports"][label]["note"] = "SearchConfig has no align option: the default configuration"
        except Exception as e:  # noqa: BLE001 - one failed export must not lose the others
            out["exports"][label] = {"error": _error(e)}
        save()
        _reset_peak(where)
    for net in nets.values():
        net.to(device, torch.bfloat16).eval()
    out["latency"] = {}
    for b in dict.fromkeys([batch or spec.train_batch(quick), 1]):
        x = _bf16(spec.make_inputs(quick, b, device))
        out["latency"][str(b)] = latency(nets, x, device, rounds)
        save()


# ----------------------------------------------------------------------------- the worker
def _error(e: BaseException) -> str:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return f"{type(e).__name__}: {e}"[:500] + "\n" + "".join(tb[-3:])[-1500:]


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def _task(name: str, spec: ModelSpec, run: dict[str, Any], device: torch.device, out: dict[str, Any],
          save: Callable[[], None]) -> None:
    if name == "train":
        train_task(spec, run["quick"], device, out, save, run["steps"], run["warmup"], run.get("compile"),
                   run.get("batch"), run.get("fuse_norms"), run.get("fold_batch"))
    else:
        export_task(spec, run["quick"], device, out, save, run["configs"], run["rounds"], run["deadline"],
                    run.get("batch"), run.get("export_device") or run["device"])


def run_spec(run: dict[str, Any]) -> dict[str, Any]:
    """Every task of one worker; the result is written to ``run["out"]`` after each arm."""
    path = Path(run["out"])
    device = torch.device(run["device"])
    if run.get("threads"):
        torch.set_num_threads(run["threads"])
    spec = SPECS[run["model"]]
    result: dict[str, Any] = {"status": "running", "env": env_info(device)}
    save = lambda: _write(path, result)  # noqa: E731
    expected = run.get("src")
    if expected and not Path(result["env"]["dmscale_file"]).resolve().is_relative_to(Path(expected).resolve()):
        result["status"] = f"wrong dmscale imported: {result['env']['dmscale_file']} (expected under {expected})"
        save()
        return result
    save()
    for name in run["tasks"]:
        out: dict[str, Any] = {}
        result[name] = out
        if time.time() > run["deadline"]:
            out["skipped"] = "time budget spent before this task"
            continue
        try:
            _task(name, spec, run, device, out, save)
        except Exception as e:  # noqa: BLE001 - report it and go on with the next task
            out["error"] = _error(e)
        save()
        _reset_peak(device)
    result["env"] = env_info(device)  # the model libraries are imported by now
    result["status"] = "done"
    save()
    return result


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    run = json.loads(Path(args[0]).read_text())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_spec(run)


if __name__ == "__main__":
    main()
