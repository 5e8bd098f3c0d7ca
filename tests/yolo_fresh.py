"""Run in a fresh process (``python tests/yolo_fresh.py CKPT DATA.yaml IMAGE OUTDIR``): load a
``yolo.pt`` with ``ultralytics.YOLO`` while ``import dmscale`` is blocked, predict, validate,
export ONNX, and print one JSON line with what happened.

The ``torchvision::nms`` kernel below is this environment's problem, not dmscale's: the
installed torchvision is a CUDA build whose compiled extension does not load on this CPU
machine, so torchvision declares ``nms`` without a kernel and Ultralytics' ``predict``/``val``
(which call ``torchvision.ops.nms``) fail in *any* process, with or without dmscale. A user
with a working torchvision needs none of this. dmscale cannot be imported here, so the test
registers its own pure-torch kernel.
"""

import importlib.abc
import json
import sys


class _BlockDmscale(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "dmscale" or name.startswith("dmscale."):
            raise ImportError(f"{name} is blocked in this process")
        return None


sys.meta_path.insert(0, _BlockDmscale())
sys.path = [p for p in sys.path if not p.rstrip("/").endswith("/src")]


def _provide_nms() -> None:
    import glob
    import importlib.util
    import os

    import numpy as np
    import torch

    root = list(importlib.util.find_spec("torchvision").submodule_search_locations)[0]
    try:
        torch.ops.load_library(glob.glob(os.path.join(root, "_C*.so"))[0])
        return
    except (OSError, RuntimeError, IndexError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

    def nms(boxes, scores, iou):
        order = scores.argsort(descending=True)
        b = boxes[order]
        area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
        lt, rb = torch.maximum(b[:, None, :2], b[None, :, :2]), torch.minimum(b[:, None, 2:], b[None, :, 2:])
        inter = (rb - lt).clamp(min=0).prod(-1)
        over = (inter / (area[:, None] + area[None] - inter).clamp(min=1e-12) > iou).numpy()
        keep, dead = [], np.zeros(len(b), dtype=bool)  # numpy: Ultralytics' NMS has a time limit
        for i in range(len(b)):
            if not dead[i]:
                keep.append(i)
                dead |= over[i]
        return order[torch.tensor(keep, dtype=torch.long)]

    impl = torch.library.Library("torchvision", "IMPL", "CPU")
    impl.impl("nms", nms)
    _provide_nms.libs = (lib, impl)  # keep the registrations alive
    import torchvision.ops.boxes

    torchvision.ops.boxes._assert_has_ops = lambda: None


def main(ckpt: str, data: str, image: str, out: str) -> dict:
    _provide_nms()
    from ultralytics import YOLO

    model = YOLO(ckpt)
    report = {"dmscale_loaded": any(m.split(".")[0] == "dmscale" for m in sys.modules),
              "params": sum(p.numel() for p in model.model.parameters()),
              "classes": sorted({type(m).__module__.split(".")[0] for m in model.model.modules()})}
    res = model.predict(image, imgsz=64, verbose=False)
    report["predict_boxes"] = int(len(res[0].boxes))
    metrics = model.val(data=data, imgsz=64, batch=8, plots=False, verbose=False, project=out, name="val")
    report["map50_95"] = float(metrics.box.map)
    onnx_path = model.export(format="onnx", imgsz=64)
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(onnx_path)
    x = np.random.default_rng(0).random((1, 3, 64, 64), dtype=np.float32)
    y = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    import torch

    with torch.no_grad():
        ref = YOLO(ckpt).model.float().eval()(torch.from_numpy(x))[0].numpy()
    report["onnx_shape"] = list(y.shape)
    report["onnx_max_diff"] = float(np.abs(y - ref).max())
    report["onnx_params"] = int(sum(int(np.prod(t.dims)) for t in __import__("onnx").load(onnx_path).graph.initializer))
    return report


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(*sys.argv[1:5])))
