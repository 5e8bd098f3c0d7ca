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

from . import attention, norms  # noqa: F401  (layer handlers register themselves)
from . import deploy, distributed
from ._compat import ensure_torchvision
from .calibrate import recalibrate_batchnorm
from .discover import discover
from .errors import DMScaleError, NoImportanceError, StructureError, UnsupportedLayerError, VerificationError
from .export import apply_structure
from .hf_export import save_pretrained
from .handlers import Handler, register_handler
from .io import load, save
from .masks import detach
from .resources import count
from .search import SearchConfig, Searcher, prepare
from .topk import DifferentiableTopK

__all__ = [
    "prepare",
    "SearchConfig",
    "Searcher",
    "count",
    "apply_structure",
    "detach",
    "save",
    "save_pretrained",
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
    "ensure_torchvision",
    "deploy",
    "distributed",
]
__version__ = "0.1.0"
