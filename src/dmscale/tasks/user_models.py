"""Models the user already has: ``--model package.module:factory``.

The name is an import path as in entry points: the module is imported (from ``sys.path``:
the installed packages and ``PYTHONPATH``) and ``factory`` (dotted attributes allowed, e.g.
``nets:Net.small``) is called with the ``--model-args`` as keyword arguments. It must return
a ``torch.nn.Module``; any callable does, a class included.

The task's facts go to the factory by name, only to the parameters its signature names
(``**kwargs`` alone receives none of them):

==================  =====================================================================
task                facts (:data:`TASK_FACTS`)
==================  =====================================================================
image (mnist,       ``num_classes``, ``in_channels``, ``image_size`` (an int for square
digits,             images, else ``(height, width)``)
imagefolder)
shakespeare         ``vocab_size``, ``seq_len``
==================  =====================================================================

A fact given in ``--model-args`` too must agree with the task's value. The example input is
the task's (one image, one sequence), as for the built-in models, and the model's output must
be the logits (or an object with ``.logits``). The run directory records the name and the
arguments in ``config.yaml``, so ``dmscale export``, ``eval`` and ``retrain`` rebuild the model
the same way: the module must be importable for them too.

Example:
    >>> import sys, types
    >>> from torch import nn
    >>> mod = types.ModuleType("doc_nets")
    >>> def build(num_classes, in_channels=3, width=8):
    ...     return nn.Sequential(nn.Conv2d(in_channels, width, 3), nn.Flatten(), nn.LazyLinear(num_classes))
    >>> mod.build = build
    >>> sys.modules["doc_nets"] = mod
    >>> net = build_user_model("doc_nets:build", {"width": 4}, {"width": 1.0, "depth": 1.0},
    ...                        {"kind": "classification", "num_classes": 10, "in_channels": 1, "image_size": [8, 8]})
    >>> net[0].in_channels, net[0].out_channels
    (1, 4)
    >>> factory_kwargs(build, {"width": 4}, {"num_classes": 10, "in_channels": 1, "image_size": 8})
    {'width': 4, 'num_classes': 10, 'in_channels': 1}
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Callable

from torch import nn

from dmscale.config.run_config import ConfigError
from dmscale.tasks.registry import register_models

__all__ = ["build_user_model", "import_factory", "factory_kwargs", "task_facts", "TASK_FACTS"]

TASK_FACTS: dict[str, tuple[str, ...]] = {
    "classification": ("num_classes", "in_channels", "image_size"),
    "language": ("vocab_size", "seq_len"),
}

_RUN_DIR_NOTE = ("a run directory of this model needs the module importable whenever it is exported, "
                 "evaluated or retrained, too")


def task_facts(info: dict[str, Any]) -> dict[str, Any]:
    """The facts of a task (its ``info``) a factory may take, by parameter name."""
    if info.get("kind") == "language":
        vocab = info.get("vocab_size", len(info.get("vocab") or []))
        return {"vocab_size": int(vocab), "seq_len": int(info["seq_len"])}
    h, w = (int(s) for s in info["image_size"])
    return {"num_classes": int(info["num_classes"]), "in_channels": int(info["in_channels"]),
            "image_size": h if h == w else (h, w)}


def _search_path_hint(top: str) -> str:
    extra = os.environ.get("PYTHONPATH", "")
    where = f"PYTHONPATH={extra}" if extra else "PYTHONPATH is not set"
    cwd = "" if "" in sys.path or os.getcwd() in sys.path else \
        "; the current directory is not on it for the dmscale command"
    return (f"Python looks for modules on sys.path: the installed packages and PYTHONPATH ({where}{cwd}); "
            f"put the folder that holds {top!r} on PYTHONPATH (PYTHONPATH=/path/to/project dmscale ...), "
            f"or pip install it")


def import_factory(name: str) -> Callable[..., Any]:
    """The callable ``module:attribute`` names.

    Raises:
        ConfigError: the module cannot be imported (not on ``sys.path``, or it raised), it
            has no such attribute, or the attribute is not callable.
    """
    module_name, _, attr = name.partition(":")
    importlib.invalidate_caches()  # a module written after this process started
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ConfigError(f"--model {name}: cannot import module {module_name!r} (ModuleNotFoundError: "
                              f"{err}). {_search_path_hint(module_name.split('.')[0])}; "
                              f"{_RUN_DIR_NOTE}") from None
        raise ConfigError(f"--model {name}: importing {module_name!r} failed: it imports {missing!r}, "
                          f"which is not installed (ModuleNotFoundError: {err}); install it") from None
    except Exception as err:  # noqa: BLE001 - any error in the user's module is theirs to fix
        raise ConfigError(f"--model {name}: importing {module_name!r} raised {type(err).__name__}: "
                          f"{str(err).strip()[:300]}") from None
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = module_name if i == 0 else f"{module_name}:{'.'.join(attr.split('.')[:i])}"
            found = sorted(n for n, v in vars(obj).items() if callable(v) and not n.startswith("_")
                           and getattr(v, "__module__", module_name) == module_name)[:8]
            where = getattr(module, "__file__", None) or "a namespace package"
            raise ConfigError(f"--model {name}: {owner} ({where}) has no attribute {part!r}"
                              + (f"; its callables: {', '.join(found)}" if found else "")) from None
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"--model {name}: {attr} is not callable (it is of type {type(obj).__name__}); "
                          "name a function or class that returns a torch.nn.Module")
    return obj


def _signature(factory: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or extension callable without a signature
        return None


def factory_kwargs(factory: Callable[..., Any], args: dict[str, Any], facts: dict[str, Any],
                   name: str = "the factory") -> dict[str, Any]:
    """The keyword arguments ``factory`` is called with: ``args`` (``--model-args``) and the
    task ``facts`` its signature names.

    Raises:
        ConfigError: an argument the factory does not take, a required parameter left out,
            or a fact in ``args`` that disagrees with the task.
    """
    sig = _signature(factory)
    if sig is None:
        return dict(args)
    params = {n: p for n, p in sig.parameters.items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_kw = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    shown = f"{getattr(factory, '__name__', 'factory')}{sig}"
    kwargs = dict(args)
    for fact, value in facts.items():
        if fact not in params:
            continue
        given = kwargs.get(fact, value)
        same = (list(given) == list(value) if isinstance(value, tuple) and isinstance(given, (list, tuple))
                else given == value)
        if not same:
            raise ConfigError(f"--model-args {fact}={given!r} for {name}: the task has {fact}={value!r} "
                              f"and passes it itself; drop {fact} from --model-args")
        kwargs[fact] = value
    unknown = [k for k in args if k not in params] if not var_kw else []
    if unknown:
        raise ConfigError(f"--model-args for {name}: {shown} takes no argument {unknown[0]!r}"
                          + (f" (nor {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else ""))
    try:
        sig.bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"--model-args for {name}: {shown} cannot be called with "
                          f"{_call_text(kwargs)} ({err}): give the missing ones with --model-args KEY=VALUE"
                          ) from None
    return kwargs


def _call_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "no arguments"


@register_models("user")
def build_user_model(name: str, args: dict[str, Any], expand: dict[str, float],
                     info: dict[str, Any]) -> nn.Module:
    """The model ``factory(**kwargs)`` of ``--model module:factory`` returns, for a task with
    ``info`` (see the module docstring for which facts it receives).

    Raises:
        ConfigError: import failures, bad ``--model-args``, ``--expand``, or a factory that
            fails or does not return an ``nn.Module``.
    """
    if expand.get("width", 1.0) != 1.0 or expand.get("depth", 1.0) != 1.0:
        raise ConfigError(f"--expand enlarges the built-in models (resnet, smallcnn, charcnn, llama), not "
                          f"--model {name}: give your factory larger sizes with --model-args")
    factory = import_factory(name)
    kwargs = factory_kwargs(factory, args, task_facts(info), f"--model {name}")
    try:
        model = factory(**kwargs)
    except Exception as err:  # noqa: BLE001 - the user's factory failed: say where, keep it one line
        raise ConfigError(f"--model {name}: calling it with {_call_text(kwargs)} raised "
                          f"{type(err).__name__}: {str(err).strip()[:300]}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {name}: it returned a {type(model).__module__}.{type(model).__name__}, "
                          "not a torch.nn.Module: the factory must return the model itself")
    return model
