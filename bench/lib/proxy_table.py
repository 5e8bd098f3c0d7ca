"""The markdown of ``bench/results/search_proxies.md`` from its cache (``python -m bench.search_proxies``;
``bench.search_overhead`` quotes it)."""

from __future__ import annotations

from typing import Any

from bench.lib.proxy_models import PROXY_MODELS

__all__ = ["render"]


def _launch_cells(r: dict[str, Any]) -> str:
    if "dms_launch" not in r:  # rows measured before the launch count existed
        return "- | -"
    return f"{r['plain_launch']:,} / {r['dms_launch']:,} | {r['launch_ratio']:.2f}"


def _order(key: str) -> tuple[int, int, str]:
    names = list(PROXY_MODELS)  # rows of models no longer in the list (older caches) last
    name, _, impl = key.partition("@")
    impls = ["before", "now", "fused"]
    return (names.index(name) if name in names else len(names)), (impls.index(impl) if impl in impls else 3), key


def render(cache: dict[str, Any]) -> str:
    """The markdown tables of a cache (rows: model x implementation; compiled: model)."""
    lines = [
        "# What a DMS step adds, measured without a GPU (issue 29)", "",
        "Written by `bench/search_proxies.py` (see its docstring for the method). Operators: top-level "
        "`aten::` operators of one training step (forward, task loss, `resource_loss(0.5)`, backward, SGD "
        "on the weights, Adam on the ratios), DMS over plain; independent of the device and of the batch. "
        "Launching: those of them that run device work (views such as `detach`, `select`, a `reshape` "
        "without a copy, casts to the dtype a tensor has and bare allocations left out), the closer proxy "
        "of kernel launches on a GPU. "
        "Saved: bytes the autograd graph holds for the backward pass when the loss is computed, at the "
        "real batch, bf16 autocast, traced with FakeTensorMode, DMS over plain (the model's own parameters "
        "and buffers, which the graph of a masked weight `W * m` refers to, are held anyway and not "
        "counted). Syncs: "
        "`aten::_local_scalar_dense` per DMS step (progress 0.5, outside the settle phase). Goals of "
        "issue 29: operators <= 1.5x, saved bytes <= 1.10x, 0 syncs.", "",
        f"- command: `{cache.get('command', '')}`",
        f"- machine: {cache.get('machine', '')}", "",
        "| model | input | code | dims | operators plain / DMS | ratio | launching plain / DMS | ratio "
        "| saved GiB plain / DMS | ratio | syncs |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in sorted(cache["rows"], key=_order):
        r = cache["rows"][key]
        lines.append(
            f"| {r['model']} | {r['shape']} | {r['impl']} | {r['dims']} | {r['plain_ops']:,} / {r['dms_ops']:,} "
            f"| {r['ops_ratio']:.2f} | {_launch_cells(r)} "
            f"| {r['plain_bytes'] / 2**30:.2f} / {r['dms_bytes'] / 2**30:.2f} | {r['bytes_ratio']:.3f} "
            f"| {r['dms_sync']} |")
    compiled = cache.get("compiled") or {}
    if compiled:
        lines += [
            "", "## Under torch.compile(model)", "",
            "The same step with the model (plain, or with DMS attached) under `torch.compile(model)` "
            "(inductor, CPU kernels profiled): launching operators per step, a generated kernel counting "
            "as one; graph kernels alone in their own column. The forward and backward of the model "
            "become fused kernels; the gates' mask computation, the resource loss, the optimisers and "
            "the backward of the eager parts stay eager, a fixed number of operators per step whatever "
            "the model's depth. Inductor fuses differently on a GPU (Triton): the kernel counts are a "
            "proxy for the launches there, not a count of them.", "",
            f"- command: `{compiled.get('command', '')}`", "",
            "| model | input | code | dims | launching plain / DMS | ratio | of which graph kernels plain / DMS "
            "| added outside the graphs |",
            "|---|---|---|---:|---:|---:|---:|---:|",
        ]
        for key in sorted(compiled["rows"], key=_order):
            r = compiled["rows"][key]
            lines.append(
                f"| {r['model']} | {r['shape']} | {r['impl']} | {r['dims']} | {r['plain_launch']:,} / "
                f"{r['dms_launch']:,} | {r['launch_ratio']:.2f} | {r['plain_kernels']:,} / {r['dms_kernels']:,} "
                f"| {r['dms_launch'] - r['plain_launch'] - (r['dms_kernels'] - r['plain_kernels']):,} |")
    return "\n".join(lines) + "\n"
