"""Hidden setup of docs/yolo.md's Python block: a CPU kernel for ``torchvision::nms``, which
this checkout's torchvision build lacks (the page's paragraph below the block explains it;
with a working torchvision nothing is needed)."""

from dmscale.integrations.ultralytics import ensure_nms

ensure_nms()
