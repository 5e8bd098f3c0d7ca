"""What a width dimension is, in words a user recognises: a layer's own channels, or a residual
stream that many blocks write.

A width dim is named by its first producer (``layer3.0.conv2``), which hides that the same
channels are written by every block of the stage and read by all of them. :func:`residual_stream`
finds the repeated container the producers sit in (a ``ModuleList`` / ``Sequential`` of blocks:
the path component before a numeric index), and :func:`dim_label` says what the dim is:

    >>> dim_label("layer3.0.conv2", ["layer3.0.conv2", "layer3.0.downsample.0", "layer3.1.conv2",
    ...                              "layer3.2.conv2"])
    'layer3 residual stream, 3 blocks'
    >>> dim_label("conv1", ["conv1", "layer1.0.conv2", "layer1.1.conv2", "layer1.2.conv2"])
    'layer1 residual stream, 3 blocks (+ conv1)'
    >>> dim_label("layer1.0.conv1", ["layer1.0.conv1"])
    'layer1.0.conv1'

The search (``keep_width=["residual"]``), the report and the width plot read it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

__all__ = ["residual_stream", "dim_label", "RESIDUAL"]

RESIDUAL = "residual"  # the keep_width word for every residual stream


def _blocks(name: str) -> list[tuple[str, str]]:
    """(container, block) for each numeric component of ``name``:
    ``stages.2.blocks.3.conv`` -> [("stages", "stages.2"), ("stages.2.blocks", "stages.2.blocks.3")]."""
    parts = name.split(".")
    return [(".".join(parts[:i]), ".".join(parts[:i + 1])) for i in range(1, len(parts)) if parts[i].isdigit()]


def residual_stream(producers: Sequence[str]) -> tuple[str, int, list[str]] | None:
    """``(container, blocks, others)`` when the layers writing a width sit in two or more blocks of
    one container (the container with the most such blocks, the deeper one on a tie), with
    ``others`` the producers outside it (a stem, an embedding); None for a width written inside one
    block (or one layer)."""
    blocks: dict[str, set[str]] = defaultdict(set)
    for p in producers:
        for container, block in _blocks(p):
            blocks[container].add(block)
    if not blocks:
        return None
    container = max(blocks, key=lambda c: (len(blocks[c]), c.count(".")))
    if len(blocks[container]) < 2:
        return None
    others = [p for p in producers if not (p == container or p.startswith(container + "."))]
    return container, len(blocks[container]), others


def dim_label(name: str, producers: Sequence[str]) -> str:
    """A width dim in words: ``"<container> residual stream, <n> blocks"`` (``(+ stem)`` for the
    producers outside the blocks) when several blocks write it, else ``name``."""
    stream = residual_stream(producers)
    if stream is None:
        return name
    container, n, others = stream
    label = f"{container or 'model'} residual stream, {n} blocks"
    if others:
        label += f" (+ {others[0]})" if len(others) == 1 else f" (+ {len(others)} layers)"
    return label
