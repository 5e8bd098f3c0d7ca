"""The exceptions dmscale raises on purpose, with one common base class.

Every error a user can meet by giving dmscale something it cannot handle derives from
:class:`DMScaleError` (catch that to catch them all), and also from the built-in exception that
fits, so code that catches the built-in keeps working: most from ``ValueError`` (a value dmscale
refuses), :class:`MissingDependencyError` from ``ImportError``, :class:`WriteError` from
``OSError`` and :class:`MissingFileError` from ``FileNotFoundError``. Messages name the layer or
value at fault, what was expected, and the fix. The public import is :mod:`dmscale.errors`.

Example:
    >>> issubclass(UnsupportedLayerError, DMScaleError), issubclass(VerificationError, ValueError)
    (True, True)
    >>> issubclass(MissingDependencyError, ImportError), issubclass(WriteError, ValueError)
    (True, False)
"""

from __future__ import annotations

__all__ = ["DMScaleError", "UnsupportedLayerError", "StructureError", "VerificationError",
           "MissingDependencyError", "ExportCheckError", "StandaloneError", "ConfigError",
           "InputError", "NothingToSearchError", "DataError", "MissingFileError", "NonFiniteLossError", "WriteError",
           "PendingImportanceError", "TraceError", "NoImportanceError"]


class DMScaleError(Exception):
    """Base class of every error dmscale raises on purpose (about a model, a structure, a
    config, a file or a missing package); each subclass also derives from a built-in."""


class UnsupportedLayerError(DMScaleError, ValueError):
    """A layer dmscale cannot shrink exactly (no handler knows what it computes)."""


class StructureError(DMScaleError, ValueError):
    """A structure does not fit the model it is applied to."""


class VerificationError(DMScaleError, ValueError):
    """A self-check failed: open masks do not reproduce the model, or an export does not
    reproduce the hardened supernet. The message names the first layer that diverges."""


class MissingDependencyError(DMScaleError, ImportError):
    """An optional package a feature needs is not installed; the message names the extra (an
    ``ImportError``, as a failed import would be)."""


class ExportCheckError(VerificationError):
    """A deployed file (ONNX, pt2) does not compute what the PyTorch model computes; the
    message names the largest difference and the tolerance."""


class StandaloneError(DMScaleError, ValueError):
    """A model about to be pickled still references dmscale classes, so it would not load
    where dmscale is not installed; the message names them and where they sit."""


class ConfigError(DMScaleError, ValueError):
    """A bad option value, config, target or run directory (the CLI prints it on one line)."""


class InputError(DMScaleError, ValueError):
    """The example inputs do not fit the model: the model itself fails on them."""


class NothingToSearchError(DMScaleError, ValueError):
    """The model has no width or depth dmscale can search (every width is fixed)."""


class DataError(DMScaleError, ValueError):
    """A data file is truncated, of the wrong format or inconsistent with its partner."""


class MissingFileError(DataError, FileNotFoundError):
    """A file dmscale needs is missing (also a ``FileNotFoundError``)."""


class NonFiniteLossError(DMScaleError, ValueError):
    """A training loss stayed NaN or infinite; the skipped steps changed nothing."""


class WriteError(DMScaleError, OSError):
    """A file could not be written (a full disk); the message says what survived (an ``OSError``,
    as the failed write was)."""


class PendingImportanceError(DMScaleError, ValueError):
    """Under torch.distributed, importance updates of the last backward are still waiting for
    their all-reduce (``Searcher.sync_importance()`` was not called): a structure read now
    would miss them."""


class NoImportanceError(DMScaleError, ValueError):
    """A structure was asked for before any importance existed: no training step with the
    task loss updated importance (Eq. 4), so the kept elements would be an arbitrary
    choice (the first ones). Train first, or search with ``importance="index"``."""


class TraceError(DMScaleError, ValueError):
    """The model runs on the example inputs but not under dmscale's trace (forward hooks and a
    ``TorchFunctionMode``); the message names the error and what to pass instead."""
