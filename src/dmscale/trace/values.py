"""The Python values around a traced call: the tensors nested in arguments and outputs, the
forms example inputs come in, and how a module packs its output.

Pure helpers with no state: the tracer, the rule table and the exporters share them.

Example:
    >>> import torch
    >>> [tuple(t.shape) for t in tensors_in((torch.ones(2), [None, {"k": torch.ones(3)}]))]
    [(2,), (3,)]
    >>> split_inputs({"x": 1})
    ((), {'x': 1})
"""

from __future__ import annotations

from typing import Any

import torch

from dmscale.core.errors import InputError

__all__ = ["tensors_in", "split_inputs", "model_outputs", "output_template", "is_inplace", "storage_of"]

_CONSTANTS = (type(None), bool, int, float, str)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj`` and in the lists, tuples and dict values nested in it, in order.

    Example:
        >>> import torch
        >>> len(tensors_in([torch.ones(1), (torch.ones(1), "s")]))
        2
    """
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Tensor -> ((t,), {}); tuple/list -> (tuple, {}); dict -> ((), dict).

    Example:
        >>> import torch
        >>> args, kwargs = split_inputs(torch.ones(1))
        >>> len(args), kwargs
        (1, {})
    """
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    raise InputError(
        "example_inputs must be a tensor, a tuple of positional inputs or a dict of keyword "
        f"inputs, got {type(example_inputs).__name__}: pass them in one of these forms"
    )


def model_outputs(out: Any) -> Any:
    """A model's output as a container :func:`tensors_in` can walk: a dict's values, a
    ``ModelOutput``'s tuple, anything else as it is.

    Example:
        >>> model_outputs({"logits": 1, "loss": 2})
        [1, 2]
    """
    if isinstance(out, dict):
        return list(out.values())
    if hasattr(out, "to_tuple"):
        return out.to_tuple()
    return out


def is_inplace(name: str) -> bool:
    """Whether the torch function ``name`` modifies its first argument (``add_``, ``+=``).

    Example:
        >>> is_inplace("add_"), is_inplace("__iadd__"), is_inplace("__init__"), is_inplace("add")
        (True, True, False, False)
    """
    if name.startswith("__"):
        return name.startswith("__i") and name not in ("__index__", "__init__", "__invert__") \
            or name == "__setitem__"
    return name.endswith("_")


def storage_of(t: torch.Tensor) -> int | None:
    """Address of ``t``'s memory (views share it); None when it has none to read.

    Example:
        >>> import torch
        >>> x = torch.ones(4)
        >>> storage_of(x[1:]) == storage_of(x)
        True
    """
    try:
        storage = t.untyped_storage()
        # a meta tensor has no memory (address 0): its storage object tells it apart
        return storage._cdata if t.device.type == "meta" else storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def output_template(out: Any) -> Any:
    """How a module packs its one output tensor, in JSON: None for a bare tensor; for a
    tuple or list ``{"type": "tuple", "items": [...]}`` with ``{"tensor": True}`` where the
    tensor goes and the other items as the constants (None, numbers, strings) they were;
    ``"opaque"`` for anything else (a dict, a cache object, a nested container), which a
    replacement could not rebuild without running the module.

    Example:
        >>> import torch
        >>> output_template((torch.ones(1), None))
        {'type': 'tuple', 'items': [{'tensor': True}, None]}
    """
    if isinstance(out, torch.Tensor):
        return None
    if type(out) in (tuple, list):
        items: list[Any] = []
        for item in out:
            if isinstance(item, torch.Tensor):
                items.append({"tensor": True})
            elif isinstance(item, _CONSTANTS):
                items.append(item)
            else:
                return "opaque"
        if sum(1 for i in items if isinstance(i, dict)) == 1:
            return {"type": type(out).__name__, "items": items}
    return "opaque"
