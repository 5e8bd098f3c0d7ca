"""The coverage suite of issue 8: every model of real registries, classified (a helper module).

Registries (:func:`entries`):

* ``timm``: one model per family (registry module) of ``timm.list_models()``, the smallest
  that builds and runs at a small input; the list, with per-model input size and time
  limit, is generated into ``tests/coverage_lists.py`` (``scripts/coverage.py --regen timm``).
* ``torchvision``: every classification model of ``torchvision.models.list_models``, at the
  smallest input it accepts (same file, ``--regen torchvision``), plus three segmentation
  models. Detection models are left out: their post-processing needs the compiled
  ``torchvision::nms``, which the pinned CPU build cannot load (see ``dmscale.core._compat``).
* ``hf``: Hugging Face transformers built from tiny configs (2 layers, hidden 64, 4 heads,
  2 KV heads where the model has them, vocab 128, intermediate 128, sdpa attention), input
  ``{"input_ids": (2, 12)}`` (images: ``pixel_values`` (2, 3, 32, 32)).
* ``ultralytics``: YOLOv8n and YOLO11n ``DetectionModel`` from their packaged yaml.

Every build seeds torch with 0 and randomises BatchNorm statistics (``zoo.randomize_bn_``), so
that BN is not the identity in eval mode. :func:`classify` runs the checks on one entry and
returns a :class:`Verdict`:

``exact``
    ``prepare`` works; all masks open (every ``a`` = 0, :meth:`Searcher.hardened`) reproduce
    the original output; after a seeded random hard structure (random importance of every
    width and depth gate, ``a`` uniform in ``[0, max_ratio]``) ``export()(x)`` equals the
    hardened supernet (eval mode); the cost at hard masks equals ``dms.count`` of the export
    for MACs and for parameters (integers); the export has fewer parameters than the
    original. Outputs are compared tensor by tensor (tuples, lists, dicts and
    ``ModelOutput`` are flattened; non-tensor leaves such as KV caches are skipped) with
    ``max|out - ref| <= TOL * (1 + max|ref|)`` per tensor.
``refused``
    ``prepare`` raised a :class:`dmscale.DMScaleError` (the message's first line is kept).
``wrong``
    one of the checks above failed (every failing check is recorded, with the numbers), or
    ``export()`` raised a :class:`dmscale.VerificationError`.
``crash``
    any other exception (type, message, innermost dmscale frame).
``timeout``
    the child process ran past its time limit (:func:`run_isolated`).
``skipped``
    the model could not be built or run *without* dmscale here (a harness problem, not a
    library one; not counted in the totals).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

__all__ = [
    "Entry", "Verdict", "VERDICTS", "REGISTRIES", "TOL", "entries", "get_entry", "classify",
    "run_isolated", "flatten_tensors", "compare_outputs",
]

REGISTRIES = ("timm", "torchvision", "hf", "ultralytics")
VERDICTS = ("exact", "refused", "wrong", "crash", "timeout", "skipped")
TOL = 1e-4  # max|out - ref| <= TOL * (1 + max|ref|), per output tensor
STRUCTURE_SEED = 0
DEFAULT_TIMEOUT = 120.0
HEAVY_PARAMS = 150_000_000  # models this big are run alone (``Entry.note == "heavy"``)
_MARK = "@@COVERAGE-VERDICT@@"
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Entry:
    """One model to classify: a deterministic builder and its example inputs.

    ``make_inputs`` returns a tensor (``model(x)``) or a dict (``model(**x)``).
    """

    registry: str
    name: str
    build: Callable[[], nn.Module]
    make_inputs: Callable[[], Any]
    timeout: float = DEFAULT_TIMEOUT
    note: str = ""


@dataclass
class Verdict:
    """The outcome of :func:`classify` for one model.

    ``macs_ratio`` / ``params_ratio``: the export's count over the original's (random hard
    structure), when the export could be counted.
    """

    verdict: str
    detail: str = ""
    seconds: float = 0.0
    macs_ratio: float | None = None
    params_ratio: float | None = None
    registry: str = ""
    name: str = ""
    checks: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Verdict":
        return cls(**{k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(cls)}})


# --------------------------------------------------------------------------- outputs
def flatten_tensors(out: Any, prefix: str = "out") -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a (nested) output with a path name; other leaves are skipped."""
    if isinstance(out, torch.Tensor):
        return [(prefix, out)]
    if isinstance(out, dict):  # includes HF ModelOutput (an OrderedDict)
        items: list[tuple[str, torch.Tensor]] = []
        for k, v in out.items():
            items += flatten_tensors(v, f"{prefix}.{k}")
        return items
    if isinstance(out, (tuple, list)):
        items = []
        for i, v in enumerate(out):
            items += flatten_tensors(v, f"{prefix}[{i}]")
        return items
    return []


def compare_outputs(out: Any, ref: Any, tol: float = TOL) -> str | None:
    """None when every tensor matches within tolerance, else a description of the first miss."""
    a, b = flatten_tensors(out), flatten_tensors(ref)
    if [n for n, _ in a] != [n for n, _ in b]:
        return f"output structure differs: {[n for n, _ in a][:6]} vs {[n for n, _ in b][:6]}"
    if not b:
        return "no tensor in the output"
    for (name, x), (_, y) in zip(a, b):
        if x.shape != y.shape:
            return f"{name}: shape {tuple(x.shape)} vs reference {tuple(y.shape)}"
        if not (x.is_floating_point() or x.is_complex()):
            if not torch.equal(x, y):
                return f"{name}: integer tensors differ in {int((x != y).sum())} elements"
            continue
        x64, y64 = x.detach().double(), y.detach().double()
        if torch.isnan(y64).any() or torch.isinf(y64).any():
            same = torch.equal(torch.isnan(x64), torch.isnan(y64))
            finite = torch.isfinite(y64)
            x64, y64 = x64[finite], y64[finite]
            if not same:
                return f"{name}: NaN pattern differs"
        if y64.numel() == 0:
            continue
        diff = float((x64 - y64).abs().max()) if x64.numel() else 0.0
        scale = float(y64.abs().max())
        if not diff <= tol * (1.0 + scale):  # catches NaN diffs too
            return f"{name}: max abs diff {diff:.3g} > {tol:g} * (1 + {scale:.3g})"
    return None


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


# --------------------------------------------------------------------------- classify
def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def _frames(err: BaseException) -> str:
    tb = traceback.extract_tb(err.__traceback__)
    inner_dms = next((f for f in reversed(tb) if f"{os.sep}dmscale{os.sep}" in f.filename), None)
    parts = []
    if inner_dms is not None:
        parts.append(f"dmscale/{inner_dms.filename.split(os.sep + 'dmscale' + os.sep)[-1]}:"
                     f"{inner_dms.lineno} in {inner_dms.name}")
    if tb and (inner_dms is None or tb[-1] is not inner_dms):
        last = tb[-1]
        short = last.filename.split("site-packages" + os.sep)[-1]
        parts.append(f"raised at {short}:{last.lineno} in {last.name}")
    return "; ".join(parts)


def _crash(stage: str, err: BaseException) -> str:
    where = _frames(err)
    msg = _first_line(err)[:400]
    return f"{stage}: {type(err).__name__}: {msg}" + (f" [{where}]" if where else "")


def _gates(searcher: Any) -> list[Any]:
    return list(searcher.gates.width) + list(searcher.gates.depth)


def random_hard_structure(searcher: Any, seed: int = STRUCTURE_SEED) -> None:
    """Random importance for every gate and ``a`` uniform in ``[0, max_ratio]`` (seeded)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in _gates(searcher):
            t.importance.copy_(torch.rand(t.importance.shape, generator=g, dtype=torch.float64)
                               .to(t.importance.dtype))
            t.a.fill_(float(torch.rand((), generator=g)) * t.max_ratio)


def _record(checks: dict[str, Any], failures: list[str], key: str, label: str, miss: str | None) -> None:
    """Store one comparison's outcome under ``key``; a mismatch also becomes a failure line."""
    checks[key] = miss or "ok"
    if miss:
        failures.append(f"{label}: {miss}")


def classify(entry: Entry, tol: float = TOL, seed: int = STRUCTURE_SEED) -> Verdict:
    """Run every check of the module docstring on ``entry`` (in this process)."""
    import dmscale as dms

    start = time.perf_counter()

    def done(verdict: str, detail: str = "", **kw: Any) -> Verdict:
        return Verdict(verdict, detail, round(time.perf_counter() - start, 2),
                       registry=entry.registry, name=entry.name, **kw)

    # ---- the model alone (a failure here is the harness's, not dmscale's)
    try:
        torch.manual_seed(0)
        model = entry.build().eval()
        inputs = entry.make_inputs()
        with torch.no_grad():
            reference = _call(model, inputs)
    except Exception as err:  # noqa: BLE001
        return done("skipped", _crash("build/reference (without dmscale)", err))
    try:
        original = dms.count(model, inputs)
    except Exception as err:  # noqa: BLE001
        return done("crash", _crash("dms.count of the original model", err))

    # ---- prepare
    try:
        searcher = dms.prepare(model, inputs, dms.SearchConfig(resource="macs", target=1.0))
    except dms.DMScaleError as err:
        return done("refused", f"{type(err).__name__}: {_first_line(err)}")
    except Exception as err:  # noqa: BLE001
        return done("crash", _crash("prepare", err))

    failures: list[str] = []
    checks: dict[str, Any] = {"width_dims": len(searcher.gates.width),
                              "depth_dims": len(searcher.gates.depth)}
    stage = "open masks"
    try:
        model.eval()
        with torch.no_grad():
            for t in _gates(searcher):
                t.a.zero_()
            with searcher.hardened():
                opened = _call(model, inputs)
        _record(checks, failures, "open_masks", "open masks != original", compare_outputs(opened, reference, tol))

        stage = "hardened forward"
        random_hard_structure(searcher, seed)
        with torch.no_grad(), searcher.hardened():
            hard = _call(model, inputs)
        stage = "export"
        try:
            small = searcher.export()
        except dms.VerificationError as err:
            failures.append(f"export raised VerificationError: {_first_line(err)}")
            return done("wrong", "; ".join(failures), checks=checks)
        small.eval()
        stage = "export forward"
        with torch.no_grad():
            out = _call(small, inputs)
        _record(checks, failures, "export_vs_hardened", "export != hardened", compare_outputs(out, hard, tol))

        stage = "count export"
        exact = dms.count(small, inputs)
        stage = "cost at hard masks"
        cost = {r: round(searcher.costs.exact("hard", r)) for r in ("macs", "params")}
        configured = round(searcher.resources()["hard"])
        checks.update(cost_macs=cost["macs"], cost_params=cost["params"], export_macs=exact["macs"],
                      export_params=exact["params"], original_macs=original["macs"],
                      original_params=original["params"])
        for r in ("macs", "params"):
            if cost[r] != exact[r]:
                failures.append(f"{r} cost at hard masks {cost[r]} != count of export {exact[r]} "
                                f"(diff {cost[r] - exact[r]:+d})")
        if configured != cost["macs"]:
            failures.append(f"resources()['hard'] {configured} != costs.exact('hard', 'macs') {cost['macs']}")
        if not exact["params"] < original["params"]:
            failures.append(f"export not smaller: {exact['params']} params vs original {original['params']}")
        ratios = dict(macs_ratio=round(exact["macs"] / max(original["macs"], 1), 4),
                      params_ratio=round(exact["params"] / max(original["params"], 1), 4))
    except Exception as err:  # noqa: BLE001
        detail = _crash(stage, err)
        if failures:
            detail = "; ".join(failures) + "; then " + detail
        return done("crash", detail, checks=checks)
    if failures:
        return done("wrong", "; ".join(failures), checks=checks, **ratios)
    return done("exact", "", checks=checks, **ratios)


# --------------------------------------------------------------------------- child process
def run_isolated(registry: str, name: str, timeout: float | None = None) -> Verdict:
    """:func:`classify` the entry ``registry/name`` in a child process with a time limit
    (the entry's own, unless ``timeout`` is given); 1 torch thread."""
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(_TESTS_DIR), "src")
    env["PYTHONPATH"] = os.pathsep.join([_TESTS_DIR, src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", YOLO_OFFLINE="1",
               YOLO_VERBOSE="False", PYTHONWARNINGS="ignore")
    if timeout is None:
        timeout = get_entry(registry, name).timeout
    cmd = [sys.executable, "-c", "import coverage_suite as c; c._child_main()", registry, name]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return Verdict("timeout", f"over the {timeout:g} s limit", round(time.perf_counter() - start, 2),
                       registry=registry, name=name)
    for line in reversed(stdout.splitlines()):
        if line.startswith(_MARK):
            return Verdict.from_json(json.loads(line[len(_MARK):]))
    tail = " | ".join((stderr or "").strip().splitlines()[-3:])[-400:]
    return Verdict("crash", f"child process died (exit {proc.returncode}): {tail}",
                   round(time.perf_counter() - start, 2), registry=registry, name=name)


def _child_main() -> None:
    registry, name = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink):
            verdict = classify(get_entry(registry, name))
    except Exception as err:  # noqa: BLE001  (get_entry itself failed)
        verdict = Verdict("skipped", _crash("registry lookup", err), registry=registry, name=name)
    print(_MARK + json.dumps(verdict.to_json()), flush=True)


# --------------------------------------------------------------------------- registries
def _seeded(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from zoo import randomize_bn_

        torch.manual_seed(0)
        return randomize_bn_(fn(), seed=0).eval()

    return build


def _image(size: int, batch: int = 2) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        g = torch.Generator().manual_seed(1)
        return torch.randn(batch, 3, size, size, generator=g)

    return make


def _vision_imports() -> None:
    import dmscale

    dmscale.ensure_torchvision()


# ---- timm
def _timm_builder(name: str, img_size: int | None) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        _vision_imports()
        import timm

        kw = {"img_size": img_size} if img_size else {}
        return timm.create_model(name, pretrained=False, num_classes=10, **kw)

    return make


def _timm_entries() -> list[Entry]:
    from coverage_lists import TIMM

    return [Entry("timm", m["name"], _seeded(_timm_builder(m["name"], m["img_size"])), _image(m["input"]),
                  timeout=m["timeout"], note="heavy" if m["params"] > HEAVY_PARAMS else m["family"])
            for m in TIMM]


# ---- torchvision
SEGMENTATION = ("fcn_resnet50", "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large")


def _tv_builder(name: str, kwargs: dict[str, Any]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        _vision_imports()
        import torchvision

        return torchvision.models.get_model(name, weights=None, **kwargs)

    return make


def _tv_entries() -> list[Entry]:
    from coverage_lists import TORCHVISION

    out = [Entry("torchvision", m["name"], _seeded(_tv_builder(m["name"], m["kwargs"])), _image(m["input"]),
                 timeout=m["timeout"], note="heavy" if m["params"] > HEAVY_PARAMS else "")
           for m in TORCHVISION]
    for name in SEGMENTATION:
        kw = {"weights_backbone": None, "num_classes": 5}
        out.append(Entry("torchvision", name, _seeded(_tv_builder(name, kw)), _image(64),
                         timeout=DEFAULT_TIMEOUT, note="segmentation"))
    return out


# ---- Hugging Face
HF_VOCAB, HF_SEQ, HF_BATCH = 128, 12, 2
_TINY = dict(vocab_size=HF_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)


def _ids() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(4, HF_VOCAB, (HF_BATCH, HF_SEQ), generator=g)}


def _pixels(size: int = 32) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return {"pixel_values": torch.randn(HF_BATCH, 3, size, size, generator=g)}

    return make


def _ids_and_pixels() -> dict[str, torch.Tensor]:
    return {**_ids(), **_pixels()()}


def _hf_builder(model_cls: str, config_cls: str, params: dict[str, Any]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        _vision_imports()
        import transformers

        cfg_type = getattr(transformers, config_cls)
        cfg = cfg_type(**params)
        for attn in ("sdpa", "eager"):
            try:
                return getattr(transformers, model_cls)._from_config(cfg, attn_implementation=attn)
            except (ValueError, ImportError):
                if attn == "eager":
                    raise
        raise AssertionError

    return make


def _decoder(**extra: Any) -> dict[str, Any]:
    return {**_TINY, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **extra}


_HF_MODELS: list[tuple[str, str, str, dict[str, Any], Callable[[], Any]]] = [
    # name, model class, config class, config, inputs
    ("llama", "LlamaForCausalLM", "LlamaConfig", _decoder(), _ids),
    ("mistral", "MistralForCausalLM", "MistralConfig", _decoder(), _ids),
    ("qwen2", "Qwen2ForCausalLM", "Qwen2Config", _decoder(), _ids),
    ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", _decoder(head_dim=16), _ids),
    ("gemma", "GemmaForCausalLM", "GemmaConfig", _decoder(head_dim=16), _ids),
    ("gemma2", "Gemma2ForCausalLM", "Gemma2Config", _decoder(head_dim=16, sliding_window=8), _ids),
    ("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", _decoder(head_dim=16, sliding_window=8), _ids),
    ("phi", "PhiForCausalLM", "PhiConfig", _decoder(), _ids),
    ("phi3", "Phi3ForCausalLM", "Phi3Config", _decoder(), _ids),
    ("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig",
     {**_decoder(), "num_key_value_heads": None}, _ids),
    ("opt", "OPTForCausalLM", "OPTConfig",
     dict(vocab_size=HF_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
          word_embed_proj_dim=64, max_position_embeddings=64, pad_token_id=1, bos_token_id=2,
          eos_token_id=2), _ids),
    ("falcon", "FalconForCausalLM", "FalconConfig",
     dict(vocab_size=HF_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
          num_kv_heads=2, new_decoder_architecture=True, ffn_hidden_size=128,
          bos_token_id=None, eos_token_id=None, pad_token_id=None), _ids),
    ("bloom", "BloomForCausalLM", "BloomConfig",
     dict(vocab_size=HF_VOCAB, hidden_size=64, n_layer=2, n_head=4, pad_token_id=None,
          bos_token_id=None, eos_token_id=None), _ids),
    ("gpt2", "GPT2LMHeadModel", "GPT2Config",
     dict(vocab_size=HF_VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, n_inner=128,
          bos_token_id=None, eos_token_id=None), _ids),
    ("stablelm", "StableLmForCausalLM", "StableLmConfig", _decoder(), _ids),
    ("olmo2", "Olmo2ForCausalLM", "Olmo2Config", _decoder(), _ids),
    ("granite", "GraniteForCausalLM", "GraniteConfig", _decoder(), _ids),
    ("mixtral", "MixtralForCausalLM", "MixtralConfig",
     _decoder(num_local_experts=4, num_experts_per_tok=2), _ids),
    ("bert", "BertModel", "BertConfig",
     dict(vocab_size=HF_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
          intermediate_size=128, max_position_embeddings=64), _ids),
    ("roberta", "RobertaModel", "RobertaConfig",
     dict(vocab_size=HF_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
          intermediate_size=128, max_position_embeddings=64), _ids),
    ("distilbert", "DistilBertModel", "DistilBertConfig",
     dict(vocab_size=HF_VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64),
     _ids),
    ("vit", "ViTForImageClassification", "ViTConfig",
     dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
          intermediate_size=128, num_labels=10), _pixels()),
    ("swin", "SwinForImageClassification", "SwinConfig",
     dict(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
          num_labels=10), _pixels()),
    ("clip", "CLIPModel", "CLIPConfig",
     dict(text_config=dict(vocab_size=HF_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=64, projection_dim=32,
                           bos_token_id=1, eos_token_id=2),
          vision_config=dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=128, projection_dim=32),
          projection_dim=32), _ids_and_pixels),
    ("t5_encoder", "T5EncoderModel", "T5Config",
     dict(vocab_size=HF_VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4), _ids),
]


def _hf_entries() -> list[Entry]:
    return [Entry("hf", name, _seeded(_hf_builder(cls, cfg, params)), inputs, timeout=DEFAULT_TIMEOUT,
                  note=cls) for name, cls, cfg, params, inputs in _HF_MODELS]


# ---- Ultralytics
def _yolo_builder(yaml: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        _vision_imports()
        from ultralytics.nn.tasks import DetectionModel

        with contextlib.redirect_stdout(io.StringIO()):
            return DetectionModel(yaml, verbose=False)

    return make


def _yolo_input() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.rand(1, 3, 64, 64, generator=g)


def _ultralytics_entries() -> list[Entry]:
    return [Entry("ultralytics", n, _seeded(_yolo_builder(f"{n}.yaml")), _yolo_input, timeout=DEFAULT_TIMEOUT,
                  note="DetectionModel") for n in ("yolov8n", "yolo11n")]


_BUILDERS = {"timm": _timm_entries, "torchvision": _tv_entries, "hf": _hf_entries,
             "ultralytics": _ultralytics_entries}


def entries(registry: str) -> list[Entry]:
    """Every entry of one registry (see the module docstring)."""
    return _BUILDERS[registry]()


def get_entry(registry: str, name: str) -> Entry:
    for e in entries(registry):
        if e.name == name:
            return e
    raise KeyError(f"no model {name!r} in registry {registry!r}")
