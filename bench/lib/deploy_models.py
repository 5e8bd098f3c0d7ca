"""The models the deployment tables time (``python -m bench.deploy_latency``,
``bench.latency_target``, ``bench.deploy_traffic``): each a builder at random init with its input
size, its export at half the MACs, its example input and a device-synchronised timer."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

import dmscale as dms
from bench.lib import gpu_check_lib

__all__ = ["DEPLOY_SIZES", "SERVING_BATCH", "LLAMA_VOCAB", "LLAMA_SEQ", "VOCAB", "Builder", "example", "models",
           "prune_half", "synced"]

DEPLOY_SIZES = (224, 640)  # image sizes the models are deployed at: classification, YOLO
SERVING_BATCH = 64
LLAMA_VOCAB, LLAMA_SEQ = 49152, 512  # SmolLM2's vocabulary; the device table's sequence length
VOCAB = {"llama_smollm2_shape (transformers)": LLAMA_VOCAB}  # rows whose input is token ids
Builder = Callable[[], nn.Module]


def _vit(size: int, name: str = "vit_tiny_patch16_224") -> Builder:
    import timm

    return lambda: timm.create_model(name, img_size=size, pretrained=False)


def _llama(small: bool = False) -> Builder:
    """:mod:`gpu_check_lib`'s Llama of SmolLM2-135M's shape (random init; ``small``: its 2-layer,
    width-64 one, for the tests), without a KV cache (a forward over the whole sequence, as a
    batch is served)."""
    def build() -> nn.Module:
        model = gpu_check_lib._llama(small)
        model.config.use_cache = False
        return model
    return build


def example(batch: int, size: int, vocab: int | None = None) -> torch.Tensor:
    """A model's input: images (batch, 3, size, size), or with ``vocab`` token ids (batch, size)."""
    g = torch.Generator().manual_seed(batch)
    if vocab is None:
        return torch.randn(batch, 3, size, size, generator=g)
    return torch.randint(0, vocab, (batch, size), generator=g)


def _yolo() -> nn.Module:
    from dmscale.integrations.ultralytics import build_yolo

    return build_yolo("yolov8n.yaml", nc=80)


def models(deploy_sizes: bool = False) -> dict[str, tuple[Builder, int]]:
    """``{row name: (builder of the model at random init, image size)}``: small images (96 px,
    YOLO 160) to keep the CPU table short, or with ``deploy_sizes`` the sizes the models are
    deployed at (:data:`DEPLOY_SIZES`: 224 px, YOLO 640) and ViT-B/16, ResNet-50 and a
    SmolLM2-shaped Llama (512 tokens; :data:`VOCAB`) first (the device table; ``--models
    vit_base resnet50 llama yolov8n`` picks the served sizes)."""
    dms.ensure_torchvision()
    import torchvision

    size, yolo = DEPLOY_SIZES if deploy_sizes else (96, 160)
    large: dict[str, tuple[Builder, int]] = {  # the device table's own models: what users serve on a GPU
        "vit_base_patch16 (timm)": (_vit(size, "vit_base_patch16_224"), size),
        "resnet50 (torchvision)": (lambda: torchvision.models.resnet50(), size),
        "llama_smollm2_shape (transformers)": (_llama(), LLAMA_SEQ),  # size: tokens per sequence
    } if deploy_sizes else {}
    return {
        **large,
        "resnet18 (torchvision)": (lambda: torchvision.models.resnet18(), size),
        "mobilenet_v3_small (torchvision)": (lambda: torchvision.models.mobilenet_v3_small(), size),
        "vit_tiny_patch16 (timm)": (_vit(size), size),
        "yolov8n (ultralytics)": (_yolo, yolo),
    }


def prune_half(build: Builder, x: torch.Tensor, align: int | None = None) -> tuple[nn.Module, nn.Module, tuple[int, int]]:
    """The model at init, its export at half the MACs (same weights) and both MACs counts;
    ``align``: ``SearchConfig.align`` (None: its default for the CPU the search runs on, 1)."""
    torch.manual_seed(0)
    original = build().eval()
    source = build().eval()
    source.load_state_dict(original.state_dict())
    # untrained: keep channels by position (only the pruned shapes matter for the timings)
    searcher = dms.prepare(source, x, dms.SearchConfig(resource="macs", target=0.5, importance="index", align=align))
    searcher.meet_target()
    pruned = searcher.export().eval()
    dms.detach(source)
    return original, pruned, (dms.count(original, x)["macs"], dms.count(pruned, x)["macs"])


def synced(fn: Callable[[Any], Any], x: Any, device: torch.device) -> Callable[[], float]:
    """A timer of ``fn(x)`` that waits for the device before and after."""
    def run() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0
    return run
