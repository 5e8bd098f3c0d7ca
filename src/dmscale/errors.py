"""Public namespace ``dmscale.errors``: every exception dmscale raises on purpose. The classes
live in :mod:`dmscale.core.errors` (the bottom layer, so every layer can raise them); this
module re-exports them.

Catch :class:`DMScaleError` for all of them, or the built-in each one also derives from:
``ValueError`` for most (a value, model or file dmscale refuses), ``ImportError`` for
:class:`MissingDependencyError`, ``OSError`` for :class:`WriteError`, ``FileNotFoundError``
for :class:`MissingFileError`.

Example:
    >>> import dmscale as dms
    >>> from dmscale.errors import ConfigError, DMScaleError, MissingDependencyError
    >>> issubclass(ConfigError, DMScaleError), issubclass(ConfigError, ValueError)
    (True, True)
    >>> issubclass(MissingDependencyError, ImportError)
    True
    >>> try:
    ...     dms.DifferentiableTopK(0)
    ... except DMScaleError as err:
    ...     print(f"{type(err).__name__}: {err}")
    ConfigError: DifferentiableTopK needs size >= 1, got 0
"""

from dmscale.core.errors import (
    ConfigError,
    DataError,
    DMScaleError,
    ExportCheckError,
    InputError,
    MissingDependencyError,
    MissingFileError,
    NoImportanceError,
    NonFiniteLossError,
    NothingToSearchError,
    PendingImportanceError,
    StandaloneError,
    StructureError,
    TraceError,
    UnsupportedLayerError,
    VerificationError,
    WriteError,
)

__all__ = ["DMScaleError", "ConfigError", "DataError", "ExportCheckError", "InputError",
           "MissingDependencyError", "MissingFileError", "NoImportanceError", "NonFiniteLossError",
           "NothingToSearchError", "PendingImportanceError", "StandaloneError", "StructureError",
           "TraceError", "UnsupportedLayerError", "VerificationError", "WriteError"]
