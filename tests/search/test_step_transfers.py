"""A search step copies nothing from the host to the device.

On a GPU, a tensor made on the host inside a step (an index list, a constant, a mask) is copied
to the device every step; from pageable memory that copy waits for the GPU, a synchronisation
the operator counts of ``bench/search_proxies.py`` do not see. Run on the ``meta`` device, the
same step shows every such copy as an operator that mixes a host tensor with device tensors:
the whole step (forward with the masks, task and resource loss, backward with the importance
update, SGD and Adam) is checked for one on real models (torchvision, timm, Hugging Face, Ultralytics). A
read-back to the host (``.item()``, a Python ``bool`` of a tensor: a synchronisation on a GPU)
raises on ``meta``, so the same steps show there is none outside the settle phase.
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import dmscale as dms


class HostTensors(TorchDispatchMode):
    """Counts the operators that take a host tensor of one or more dims together with ``meta``
    tensors, or move a tensor between the host and ``meta`` (0-d host tensors are scalars, as on
    a GPU: Adam's step counters)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        on_device = any(t.device.type == "meta" for t in inputs + outputs)
        from_host = any(t.device.type == "cpu" and t.dim() > 0 for t in inputs)
        to_host = any(t.device.type == "cpu" for t in outputs) and any(t.device.type == "meta" for t in inputs)
        if (on_device and from_host) or to_host:
            self.found[(str(func), "".join(traceback.format_stack(limit=6)[:-1]))] += 1
        return out


def _resnet() -> tuple[torch.nn.Module, torch.Tensor]:
    dms.ensure_torchvision()
    import torchvision
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 32, 32)


def _mobilenet() -> tuple[torch.nn.Module, torch.Tensor]:  # depthwise convolutions: grouped folds
    dms.ensure_torchvision()
    import torchvision
    torch.manual_seed(0)
    return torchvision.models.mobilenet_v2(num_classes=10), torch.randn(2, 3, 32, 32)


def _vit() -> tuple[torch.nn.Module, torch.Tensor]:
    dms.ensure_torchvision()
    import timm
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32), \
        torch.randn(2, 3, 32, 32)


def _llama() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    dms.ensure_torchvision()
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg), {"input_ids": torch.randint(0, 64, (2, 8))}


def _yolo() -> tuple[torch.nn.Module, torch.Tensor]:
    import os
    os.environ.setdefault("YOLO_VERBOSE", "False")
    pytest.importorskip("ultralytics")
    dms.ensure_torchvision()
    from ultralytics.nn.tasks import DetectionModel
    torch.manual_seed(0)
    return DetectionModel("yolov8n.yaml", verbose=False), torch.rand(1, 3, 64, 64)


def _loss(out, x) -> torch.Tensor:  # noqa: ANN001
    out = out.logits if hasattr(out, "logits") else out  # a detector's training output: a dict of maps
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(o.float().square().mean() for o in outs)


def _step_on_meta(build) -> collections.Counter:  # noqa: ANN001
    """Prepare on the host, move everything to ``meta``, run two steps, then watch a third."""
    model, x = build()
    searcher = dms.prepare(model, x, dms.SearchConfig("macs", 0.5))
    model.to("meta")
    x = {k: v.to("meta") for k, v in x.items()} if isinstance(x, dict) else x.to("meta")
    opt_w = torch.optim.SGD(list(searcher.model_parameters()), lr=0.1, foreach=True)
    opt_s = torch.optim.Adam(searcher.structure_parameters(), lr=0.01, foreach=True)

    def step() -> None:
        out = model(**x) if isinstance(x, dict) else model(x)
        loss = _loss(out, x) + searcher.resource_loss(0.3)
        opt_w.zero_grad(), opt_s.zero_grad()
        loss.backward()
        opt_w.step(), opt_s.step()

    step(), step()  # optimiser state, importance
    with HostTensors() as mode:
        step()
    return mode.found


@pytest.mark.parametrize("build", [_resnet, _mobilenet, _vit, _llama, _yolo],
                         ids=["torchvision_resnet", "torchvision_mobilenet", "timm_vit", "hf_llama", "ultralytics"])
def test_a_search_step_on_the_device_takes_no_tensor_from_the_host(build):
    found = _step_on_meta(build)
    assert not found, "host tensors in a step:\n" + "\n".join(f"{n}x {f}\n{w}" for (f, w), n in found.items())


def test_the_watch_finds_a_host_tensor_put_into_a_step():
    def build():  # noqa: ANN202
        model, x = _resnet()
        model.fc.register_forward_hook(lambda m, a, out: out + torch.zeros(out.shape[-1]).to(out.device))  # copied in
        return model, x
    found = _step_on_meta(build)
    assert any("_to_copy" in f for f, _ in found), found
