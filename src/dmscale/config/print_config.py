"""The text of ``--print-config``: a run's options, resolved, as YAML a ``--config`` file
takes back (:func:`config_yaml`)."""

from __future__ import annotations

import yaml

from dmscale.config.defaults import MIN_STRUCTURE_LR, STRUCTURE_REACH
from dmscale.config.options import OPTIONS
from dmscale.config.run_config import RunConfig

__all__ = ["config_yaml"]


def config_yaml(cfg: RunConfig) -> str:
    """The options of ``cfg``'s command, resolved, as YAML a ``--config`` file takes back.

    Keys are the long flags without dashes (``structure-lr``); options left at None and the
    run directory (``out``, given per run) are left out. An option resolved from ``auto``
    carries a comment saying why; the structure lr, which the search's length sets, stays
    ``auto`` with its rule.

    Example:
        >>> text = config_yaml(RunConfig(command="search", task="digits", target=0.4))
        >>> "target: 0.4" in text, "optimizer: sgd  # auto for digits" in text
        (True, True)
    """
    resolved = cfg.resolved()
    lines = []
    for opt in OPTIONS:
        if cfg.command not in opt.commands or opt.name in ("out", "quiet"):
            continue
        key = opt.name.replace("_", "-")
        value = getattr(resolved, opt.name, None)
        if value is None and opt.name == "structure_lr":
            lines.append(f"{key}: auto  # max({MIN_STRUCTURE_LR:g}, {STRUCTURE_REACH:g} / search "
                         "steps), set when the run starts")
            continue
        if value is None:
            continue
        text = yaml.safe_dump({key: list(value) if isinstance(value, tuple) else value},
                              default_flow_style=True, width=float("inf")).strip()[1:-1]  # {k: v}
        why = resolved.chosen.get(opt.name)
        lines.append(text + (f"  # {why}" if why else ""))
    return (f"# dmscale {cfg.command}: resolved options (dmscale {cfg.command} --config FILE)\n"
            + "\n".join(lines) + "\n")
