"""dmscale: Differentiable Model Scaling (DMS, ICML 2024) for PyTorch.

Learn how wide and how deep a network should be under a MACs, parameter or latency budget,
with one differentiable top-k per structural dimension, then export a smaller model.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import dmscale as dms
    >>> net = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(),
    ...                     nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    >>> x = torch.randn(1, 3, 16, 16)
    >>> searcher = dms.prepare(net, x, dms.SearchConfig(resource="macs", target=0.5))
    >>> y = torch.tensor([3])
    >>> loss = nn.functional.cross_entropy(net(x), y) + searcher.resource_loss(progress=1.0)
    >>> loss.backward()  # one search step (no optimizer here): importance from the task loss
    >>> small = searcher.export()
    >>> _ = dms.detach(net)
"""

from dmscale import deploy, distributed, errors
from dmscale.core._compat import ensure_torchvision, install_torchvision_fix
from dmscale.core.errors import DMScaleError, NoImportanceError, StructureError, UnsupportedLayerError, VerificationError
from dmscale.core.masks import detach
from dmscale.core.topk import DifferentiableTopK
from dmscale.cost.resources import count
from dmscale.export.calibrate import recalibrate_batchnorm
from dmscale.export.files import load, save
from dmscale.export.hf import save_pretrained
from dmscale.export.gguf import save_gguf
from dmscale.export.shrink import apply_structure
from dmscale.integrations.lm_eval import evaluate_lm
from dmscale.search.searcher import SearchConfig, Searcher, prepare
from dmscale.trace.discover import discover
from dmscale.trace.handlers import attention, norms  # noqa: F401  (layer handlers register themselves)
from dmscale.trace.handlers.base import Handler, register_handler

__all__ = [
    "prepare",
    "SearchConfig",
    "Searcher",
    "count",
    "apply_structure",
    "detach",
    "save",
    "save_pretrained",
    "save_gguf",
    "evaluate_lm",
    "load",
    "recalibrate_batchnorm",
    "discover",
    "register_handler",
    "Handler",
    "DifferentiableTopK",
    "UnsupportedLayerError",
    "StructureError",
    "DMScaleError",
    "VerificationError",
    "NoImportanceError",
    "deploy",
    "distributed",
    "errors",
]
__version__ = "0.1.0"

install_torchvision_fix()  # `import torchvision` after `import dmscale` works even where its extension cannot load
