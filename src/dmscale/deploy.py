"""Public namespace ``dmscale.deploy``: ONNX, ``torch.export`` (.pt2) and pickles of an
exported model. The code lives in :mod:`dmscale.export.deploy`; this module re-exports it.

Example:
    >>> import dmscale as dms
    >>> dms.deploy.to_onnx is to_onnx
    True
"""

from dmscale.export.deploy import (
    CHECK_BATCHES,
    DEPLOY_EXTRA,
    batch_is_dynamic,
    check_onnx,
    check_pt2,
    dmscale_classes,
    dmscale_modules,
    save_pickled,
    to_onnx,
    to_pt2,
    with_batch,
)

__all__ = ["to_onnx", "to_pt2", "check_onnx", "check_pt2", "dmscale_classes", "dmscale_modules",
           "save_pickled", "batch_is_dynamic", "with_batch", "DEPLOY_EXTRA", "CHECK_BATCHES"]
