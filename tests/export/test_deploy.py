"""Deployment (issue 14, point 4): exports hold torch / library classes only, torch.save of
them loads in a process where dmscale cannot be imported, and ONNX / pt2 files compute what
the PyTorch export computes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import dmscale as dms
from dmscale import deploy
from dmscale.core.errors import ExportCheckError, MissingDependencyError, StandaloneError
from dmscale.export.shrink import SkipBlock

HAS_ONNX = all(importlib.util.find_spec(p) for p in ("onnx", "onnxscript", "onnxruntime"))
needs_onnx = pytest.mark.skipif(not HAS_ONNX, reason="onnx/onnxscript/onnxruntime not installed "
                                "(pip install dmscale[deploy])")

# A fresh interpreter in which `import dmscale` fails, whatever is installed or on the path.
_PRELUDE = textwrap.dedent("""
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name == "dmscale" or name.startswith("dmscale."):
                raise ImportError("dmscale is blocked in this process")
            return None
    sys.meta_path.insert(0, _Block())
    import torch
    try:  # this machine's torchvision build needs its operator schemas declared first
        import torchvision  # noqa: F401
    except Exception:
        for k in [k for k in sys.modules if k.startswith("torchvision")]:
            del sys.modules[k]
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    try:
        import dmscale  # noqa: F401
        raise SystemExit("dmscale imported although blocked")
    except ImportError:
        pass
""")


def run_without_dmscale(code: str, cwd: Path) -> str:
    """Run ``code`` in a fresh Python that cannot import dmscale; returns its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _remove_blocks(searcher: dms.Searcher, keep: int) -> None:
    """Keep the first ``keep`` blocks of each depth dim (the searchers here are built with
    importance="index": no training, position decides on purpose)."""
    with torch.no_grad():
        for gate in searcher.gates.depth:
            gate.set_count(keep)


def _resnet18() -> nn.Module:
    dms.ensure_torchvision()
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).eval()


def _vit() -> nn.Module:
    dms.ensure_torchvision()
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10,
                             pretrained=False).eval()


class _Plain(nn.Module):
    """``x + f(x)``: no post activation."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


class _Post(_Plain):
    """``silu(x + f(x))``: a post activation, as a function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x + self.f(x))


def _small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), _Post(8), _Post(8), _Plain(8),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()


def test_removed_blocks_become_torch_modules():
    net, x = _small_net(), torch.randn(2, 3, 8, 8)
    searcher = dms.prepare(net, x, dms.SearchConfig(resource="macs", target=1.0, search_width=False, importance="index"))
    _remove_blocks(searcher, 0)
    with torch.no_grad(), searcher.hardened():
        hard = net(x)
    small = searcher.export().eval()
    assert [type(small[i]) for i in (2, 3, 4)] == [nn.SiLU, nn.SiLU, nn.Identity]
    assert deploy.dmscale_classes(small) == []
    with torch.no_grad():
        torch.testing.assert_close(small(x), hard)


def test_a_block_that_still_needs_dmscale_says_so(tmp_path):
    net = nn.Sequential(nn.Linear(2, 2), SkipBlock(nn.ReLU()))
    assert deploy.dmscale_classes(net) == ["dmscale.export.SkipBlock"]
    assert deploy.dmscale_modules(net) == {"1": "dmscale.export.SkipBlock"}
    with pytest.raises(StandaloneError, match=r"SkipBlock.*at 1 \(SkipBlock\)"):
        deploy.save_pickled(net, tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists()
    with pytest.warns(UserWarning, match="needs dmscale"):
        assert deploy.save_pickled(net, tmp_path / "m.pt", allow_dmscale=True) == ["dmscale.export.SkipBlock"]
    # and an old structure file (no "inputs"/"mutated" keys) still gets the SkipBlock it had
    structure = {"format": "dmscale.structure/1", "layers": {}, "removed_blocks": [{"name": "1"}]}
    old = dms.apply_structure(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), structure)
    assert isinstance(old[1], SkipBlock)


def test_torch_save_of_exports_loads_without_dmscale(tmp_path):
    """torchvision ResNet (post-ReLU blocks), timm ViT (plain blocks) and a net with a
    functional post activation, each with removed blocks: torch.save loads in a process that
    cannot import dmscale, keeps the library's class and attributes, and computes the same."""
    x = torch.randn(1, 3, 32, 32)
    cases = {"resnet": (_resnet18(), 1), "vit": (_vit(), 10), "post": (_small_net(), 0)}
    for name, (model, keep) in cases.items():
        inp = x if name != "post" else torch.randn(1, 3, 8, 8)
        searcher = dms.prepare(model, inp, dms.SearchConfig(resource="macs", target=1.0, search_width=False, importance="index"))
        _remove_blocks(searcher, keep)
        assert searcher.structure()["removed_blocks"], name
        small = searcher.export().eval()
        assert deploy.dmscale_classes(small) == [], name
        deploy.save_pickled(small, tmp_path / f"{name}.pt")
        torch.save({"x": inp, "y": small(inp).detach()}, tmp_path / f"{name}.io.pt")
    out = run_without_dmscale("""
        import torch
        for name in ("resnet", "vit", "post"):
            m = torch.load(f"{name}.pt", weights_only=False)
            io = torch.load(f"{name}.io.pt")
            with torch.no_grad():
                diff = (m(io["x"]) - io["y"]).abs().max().item()
            assert diff < 1e-5, (name, diff)
            extra = (m.pretrained_cfg["architecture"], m.default_cfg["architecture"], m.num_classes) \\
                if name == "vit" else ""
            print(name, type(m).__module__, type(m).__name__, extra)
    """, tmp_path)
    lines = out.splitlines()
    assert lines[0] == "resnet torchvision.models.resnet ResNet "
    assert lines[1] == ("vit timm.models.vision_transformer VisionTransformer "
                        "('vit_tiny_patch16_224', 'vit_tiny_patch16_224', 10)")
    assert lines[2] == "post torch.nn.modules.container Sequential "


def test_torchvision_export_keeps_class_and_attributes():
    model = _resnet18()
    searcher = dms.prepare(model, torch.randn(1, 3, 32, 32), dms.SearchConfig(resource="macs", target=0.5, importance="index"))
    searcher.meet_target()
    small = searcher.export()
    assert type(small).__name__ == "ResNet" and type(small.layer1[0]).__name__ == "BasicBlock"
    assert small.fc.out_features == 10 and small.fc.in_features < 512


class _Tiny(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x * 2, {"sum": x.sum(1)}


def test_pt2_roundtrip_and_check_catches_a_wrong_file(tmp_path):
    model, x = _Tiny(), torch.randn(3, 4)
    p = deploy.to_pt2(model, x, tmp_path / "t.pt2")
    assert deploy.check_pt2(p, model, x) == 0.0

    class _Other(_Tiny):
        def forward(self, x):
            y, d = super().forward(x)
            return y + 1e-3, d

    with pytest.raises(ExportCheckError, match=r"max \|diff\| 0.001.*tolerance atol=1e-05"):
        deploy.check_pt2(p, _Other(), x)


def test_onnx_missing_packages_name_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "onnxruntime" else real(n, *a))
    with pytest.raises(MissingDependencyError, match=r"onnxruntime (is|are) not installed.*dmscale\[deploy\]"):
        deploy.to_onnx(_Tiny(), torch.randn(2, 2), "unused.onnx")


def _pruned(model: nn.Module, x: torch.Tensor) -> nn.Module:
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="macs", target=0.5, importance="index"))
    searcher.meet_target()
    small = searcher.export().eval()
    ratio = dms.count(small, x)["macs"] / searcher.resources()["supernet"]
    assert 0.4 < ratio <= 0.5 + 1e-3, ratio
    return small


def _onnx_and_pt2(small: nn.Module, x: torch.Tensor, d: Path, name: str) -> None:
    deploy.to_onnx(small, x, d / f"{name}.onnx")  # checked against PyTorch in onnxruntime
    deploy.to_pt2(small, x, d / f"{name}.pt2")  # checked after torch.export.load
    leaves = [t.detach() for t in torch.utils._pytree.tree_leaves(small(x)) if isinstance(t, torch.Tensor)]
    torch.save({"x": x, "y": leaves}, d / f"{name}.io.pt")
    out = run_without_dmscale(f"""
        import torch
        m = torch.export.load("{name}.pt2").module()
        io = torch.load("{name}.io.pt")
        got = torch.utils._pytree.tree_leaves(m(io["x"]))
        print(max((a - b).abs().max().item() for a, b in zip(got, io["y"])))
    """, d)
    assert float(out) < 1e-5


@needs_onnx
def test_onnx_and_pt2_of_a_pruned_cnn(tmp_path):
    from dmscale.tasks.models import ResNetCifar

    torch.manual_seed(0)
    model = ResNetCifar(depth=14, width=8, num_classes=10).eval()
    x = torch.randn(1, 3, 16, 16)
    small = _pruned(model, x)
    deploy.to_onnx(small, x, tmp_path / "cnn.onnx")
    deploy.to_pt2(small, x, tmp_path / "cnn.pt2")
    with pytest.raises(ExportCheckError, match="ONNX file .* max"):
        deploy.check_onnx(tmp_path / "cnn.onnx", model, x)  # the unpruned model differs


@pytest.mark.slow
@needs_onnx
def test_onnx_and_pt2_of_resnet18_and_vit(tmp_path):
    _onnx_and_pt2(_pruned(_resnet18(), torch.randn(1, 3, 32, 32)), torch.randn(1, 3, 32, 32), tmp_path, "resnet")
    _onnx_and_pt2(_pruned(_vit(), torch.randn(1, 3, 32, 32)), torch.randn(2, 3, 32, 32), tmp_path, "vit")


@pytest.mark.slow
@needs_onnx
def test_onnx_and_pt2_of_yolov8n(tmp_path):
    dms.ensure_torchvision()
    from ultralytics.nn.tasks import DetectionModel

    torch.manual_seed(0)
    model = DetectionModel("yolov8n.yaml", verbose=False).eval()
    x = torch.randn(1, 3, 64, 64)
    _onnx_and_pt2(_pruned(model, x), x, tmp_path, "yolo")


# ----------------------------------------------------------------------------- dynamic batch (issue 14)
def _small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()


def _small_vit() -> nn.Module:
    dms.ensure_torchvision()  # before timm imports torchvision
    timm = pytest.importorskip("timm")

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10,
                             pretrained=False).eval()


class _FixedBatch(nn.Module):
    """Its code fixes the batch size at 2 (``reshape(2, -1)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(2, -1).sum(1)


def _in_onnxruntime(path: Path, x: torch.Tensor) -> torch.Tensor:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])


@needs_onnx
@pytest.mark.parametrize("make", [_small_cnn, _small_vit], ids=["cnn", "vit"])
def test_onnx_and_pt2_take_any_batch_size(make, tmp_path: Path) -> None:
    """Exported from an example of batch 1, the ONNX file (in onnxruntime) and the .pt2 (after
    torch.export.load) compute what PyTorch computes at batch 1 and at batch 3."""
    import onnxruntime as ort

    model, x = make(), torch.randn(1, 3, 32, 32)
    onnx_path = deploy.to_onnx(model, x, tmp_path / "m.onnx")
    pt2_path = deploy.to_pt2(model, x, tmp_path / "m.pt2")
    assert deploy.batch_is_dynamic(onnx_path) and deploy.batch_is_dynamic(pt2_path)
    assert ort.InferenceSession(str(onnx_path)).get_inputs()[0].shape[0] == "batch"
    loaded = torch.export.load(str(pt2_path)).module()
    for n in (1, 3):
        xn = deploy.with_batch(torch.randn(2, 3, 32, 32), n)
        with torch.no_grad():
            ref = model(xn)
            torch.testing.assert_close(_in_onnxruntime(onnx_path, xn), ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(loaded(xn), ref, atol=1e-5, rtol=1e-5)


def test_a_model_that_fixes_its_batch_size_is_exported_static_with_a_warning(tmp_path: Path) -> None:
    model, x = _FixedBatch(), torch.randn(2, 3)
    with pytest.warns(UserWarning, match=r"_FixedBatch cannot be exported with a dynamic batch size "
                                         r"\(.*specialized it to be a constant \(2\)\); exporting for batch 2 only"):
        path = deploy.to_pt2(model, x, tmp_path / "f.pt2")
    assert not deploy.batch_is_dynamic(path)
    if HAS_ONNX:
        with pytest.warns(UserWarning, match="cannot be exported with a dynamic batch size"):
            path = deploy.to_onnx(model, x, tmp_path / "f.onnx")
        assert not deploy.batch_is_dynamic(path)
        torch.testing.assert_close(_in_onnxruntime(path, x), model(x))


def test_dynamic_batch_false_keeps_the_example_shapes(tmp_path: Path) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = deploy.to_pt2(_FixedBatch(), torch.randn(2, 3), tmp_path / "f.pt2", dynamic_batch=False)
        static = deploy.to_pt2(_small_cnn(), torch.randn(2, 3, 8, 8), tmp_path / "c.pt2", dynamic_batch=False)
    assert not deploy.batch_is_dynamic(path) and not deploy.batch_is_dynamic(static)
    assert deploy.batch_is_dynamic(deploy.to_pt2(_small_cnn(), torch.randn(2, 3, 8, 8), tmp_path / "d.pt2"))


def test_with_batch_resizes_only_batched_inputs() -> None:
    ids, mask, table = torch.arange(6).view(2, 3), torch.ones(2, 3), torch.zeros(5, 2)
    out = deploy.with_batch({"input_ids": ids, "attention_mask": mask, "table": table}, 3)
    assert out["input_ids"].tolist() == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]
    assert out["attention_mask"].shape == (3, 3) and out["table"] is table


def test_pickles_name_skipblock_by_its_stable_path(tmp_path):
    """A torch.save of an export names dmscale.export.SkipBlock (the path files had before the
    layered layout), and such a file loads: the class resolves there."""
    net = nn.Sequential(nn.Linear(2, 2), SkipBlock(nn.ReLU()))
    torch.save(net, tmp_path / "m.pt")
    import zipfile

    with zipfile.ZipFile(tmp_path / "m.pt") as z:
        data = b"".join(z.read(n) for n in z.namelist() if n.endswith("data.pkl"))
    assert b"dmscale.export\nSkipBlock" in data
    assert b"dmscale.export.shrink" not in data
    back = torch.load(tmp_path / "m.pt", weights_only=False)
    assert type(back[1]) is SkipBlock
    x = torch.randn(3, 2)
    torch.testing.assert_close(back(x), net(x))
