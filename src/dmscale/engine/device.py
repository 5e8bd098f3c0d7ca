"""Where and how a step runs: device, CPU threads, mixed precision, torch.compile.

* :func:`resolve_device`: ``auto`` / ``cpu`` / ``cuda``, with a clear error when CUDA is
  asked for and absent;
* :class:`Precision`: ``--precision 32 | bf16 | fp16``. bf16 and fp16 run the forward and
  the loss under ``torch.autocast(device.type, dtype)``; fp16 also scales the loss with a
  ``torch.amp.GradScaler(device.type)``, whose state goes into the checkpoint. Autocast never
  changes a parameter's dtype: the structural parameters ``a`` and the importance buffers
  stay float32;
* :func:`compiled_forward`: ``--compile`` runs the model's ``forward`` under
  ``torch.compile`` for the duration of a phase. The model's own forward pre-hook (where the
  gates compute every mask once and hook importance onto the soft masks' gradients) runs
  eagerly, outside the compiled graph; the layers and their mask hooks run compiled, with
  the masks as graph inputs. Nothing else about the model changes (state dict, copies).

Example:
    >>> import torch
    >>> p = Precision("bf16", torch.device("cpu"))
    >>> with p.autocast():
    ...     y = torch.nn.Linear(4, 2)(torch.ones(1, 4))
    >>> y.dtype, p.scaler is None, Precision("32", torch.device("cpu")).dtype
    (torch.bfloat16, True, None)
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from dmscale.core.errors import ConfigError

__all__ = ["PRECISIONS", "COMPILE_BACKEND", "Precision", "compiled_forward", "resolve_device",
           "set_threads"]

PRECISIONS = ("32", "bf16", "fp16")
COMPILE_BACKEND = "inductor"  # torch.compile's default; tests use "aot_eager" (fast, no C++ build)

_DTYPES = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cuda`` without CUDA is a ConfigError.

    Under torchrun (``WORLD_SIZE > 1``) ``cuda`` means ``cuda:LOCAL_RANK``, and a node with
    fewer GPUs than processes is a ConfigError.
    """
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device is available (torch "
                          f"{torch.__version__} sees none); use --device cpu or auto")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s), "
                          f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if name.startswith("cuda:") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"--device {name} under torchrun: every process would use the same GPU; "
                          "use --device cuda (each process takes cuda:LOCAL_RANK)")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _local_gpu()
    return device


def _local_gpu() -> torch.device:
    """``cuda:LOCAL_RANK`` for one of several processes of a node (torchrun)."""
    local, n = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= n:
        raise ConfigError(f"--device cuda under torchrun: local rank {local} has no GPU of its own "
                          f"(this node has {n}); start at most {n} processes per node "
                          f"(--nproc_per_node {n}), or use --device cpu")
    return torch.device("cuda", local)


def set_threads(threads: int | None) -> int:
    """Set torch's CPU threads: ``threads``, or by default the idle cores (at least 1).

    torch uses every core by default; when other processes keep them busy, OpenMP threads
    that wait on each other make a step several times slower than one thread would.
    """
    if threads is None:
        cores = os.cpu_count() or 1
        try:
            busy = os.getloadavg()[0]
        except (AttributeError, OSError):
            busy = 0.0
        threads = max(1, min(torch.get_num_threads(), cores - int(busy + 0.5)))
    torch.set_num_threads(threads)
    return threads


@dataclass
class Precision:
    """Autocast and gradient scaling of one run (``--precision``).

    Args:
        name: ``"32"`` (no autocast), ``"bf16"`` or ``"fp16"`` (autocast + GradScaler).
        device: where the steps run; autocast and the scaler use its type.
    """

    name: str
    device: torch.device
    scaler: Any = field(init=False, default=None)  # torch.amp.GradScaler for fp16

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ConfigError(f"--precision: expected one of {', '.join(PRECISIONS)}; got {self.name!r}")
        if self.name == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("--precision bf16: this CUDA device has no bfloat16 support; "
                              "use --precision fp16 (or 32)")
        if self.name == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type)

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype; None for full precision."""
        return _DTYPES[self.name]

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context the forward and the loss run in."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def _compile_error(err: Exception) -> ConfigError:
    cause = getattr(err, "inner_exception", None) or err  # BackendCompilerFailed wraps the cause
    first = (str(cause).strip().splitlines() or [""])[0][:200]
    backend = getattr(COMPILE_BACKEND, "__name__", COMPILE_BACKEND)
    return ConfigError(f"--compile: torch.compile (backend {backend}) failed on this model "
                       f"({type(cause).__name__}: {first}); run without --compile")


@contextlib.contextmanager
def compiled_forward(model: nn.Module, enabled: bool = True) -> Iterator[nn.Module]:
    """Run ``model.forward`` under ``torch.compile`` inside the block (see the module text).

    A compilation that fails is a :class:`ConfigError` saying to run without ``--compile``;
    it fails on the first forward of the phase, before the first optimizer step.
    """
    if not enabled:
        yield model
        return
    compiled = torch.compile(model.forward, backend=COMPILE_BACKEND)
    model.forward = _checked(compiled)  # type: ignore[method-assign]
    try:
        yield model
    finally:
        del model.forward  # the class's forward again


def _checked(fn: Callable[..., Any]) -> Callable[..., Any]:
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException

    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (BackendCompilerFailed, TorchDynamoException) as err:
            raise _compile_error(err) from None

    return forward
