"""The search trace: per structural dimension, what moved its pruning ratio during a search.

A dimension's ratio ``a`` moves by the sum of two gradients: the task loss's (Eq. 3's soft mask
times the importance of the elements near the threshold) and the resource loss's (Eq. 6: the
cost of one more element, times ``resource_weight / r_c`` while over the target). Which one wins
decides what the search keeps, and a dimension that many layers share (a residual stream) has a
far higher cost per channel than a layer's own width while Eq. 2's rank normalisation spreads
every dimension's importance on the same [0, 1). :class:`SearchTrace` records, every few steps,
for every width and depth dim:

* ``a``, the hard count kept and the soft count (the sum of Eq. 3's mask);
* ``grad_task`` / ``grad_resource``: d(loss)/d(a) split into its two parts (the resource part
  by ``torch.autograd.grad`` of the resource loss alone, before the backward; the task part
  is the rest of the step's gradient, distillation included);
* ``cost_per_element``: d(r_c)/d(a) over d(soft count)/d(a), the differentiable cost of one
  element of the dim in the budget's resource (MACs, parameters, ...);
* ``importance_mean`` / ``importance_marginal``: the raw importance (Eq. 4's moving average)
  per unit, its mean and the value of the lowest-ranked kept unit, which Eq. 2 normalises away.

It writes ``search_trace.jsonl`` in the run directory: a header line (``{"dims": [...]}`` with
each dim's name, what it is (:func:`~dmscale.trace.naming.dim_label`), kind and size), then one
line per traced step. ``dmscale inspect RUN --search-trace`` prints it
(:func:`dmscale.run.inspect.format_search_trace`); the report plots it. The trace reads the
gradients the step computes anyway and changes no value of the search.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch

from dmscale.core.ratios import ratio_leaf
from dmscale.trace.naming import dim_label

__all__ = ["SearchTrace", "TRACE_FILE", "TRACE_RECORDS", "read_trace"]

TRACE_FILE = "search_trace.jsonl"
TRACE_RECORDS = 100  # traced steps per phase at most (every total // 100 steps)
FIELDS = ("a", "kept", "soft", "grad_task", "grad_resource", "cost_per_element", "importance_mean",
          "importance_marginal")


def _num(x: float) -> float:
    return float(f"{x:.6g}")


class SearchTrace:
    """Record :mod:`the search trace <dmscale.search.search_trace>` of ``searcher`` into
    ``run_dir / TRACE_FILE`` every ``total // TRACE_RECORDS`` steps of a phase.

    The step loop runs each backward inside :meth:`step`: on a traced step (:meth:`wants`) it
    calls :meth:`before_backward` with the step's resource loss (its gradient alone, the graph
    kept for the backward) and :meth:`after_step` once the optimizers have stepped (the step's
    gradients are still on the ratios).
    """

    def __init__(self, searcher: Any, run_dir: str | Path, writes: bool = True) -> None:
        self.searcher = searcher
        self.path = Path(run_dir) / TRACE_FILE
        self.writes = writes
        gates = searcher.gates
        self.gates = list(gates.width) + list(gates.depth)
        space = searcher.space
        self.sizes = [d.size for d in space.width] + [len(d.blocks) for d in space.depth]
        self.dims = ([{"name": d.name, "label": dim_label(d.name, d.producers), "kind": d.kind,
                       "size": d.size, "layers": len(d.producers)} for d in space.width]
                     + [{"name": d.name, "label": f"{d.name} blocks", "kind": "depth",
                         "size": len(d.blocks), "layers": len(d.blocks)} for d in space.depth])
        self._pending: dict[str, list[float]] | None = None

    # ------------------------------------------------------------------ the step loop's calls
    @contextlib.contextmanager
    def step(self, phase: str, step: int, total: int, out: Any) -> Iterator[None]:
        """Around the backward and optimizer steps of step ``step`` (1-based) of ``total``:
        traced when :meth:`wants` it (``out``: the loop's StepOutput, its ``resource_loss``)."""
        traced = self.wants(step, total)
        if traced:
            self.before_backward(out.resource_loss)
        yield
        if traced:
            self.after_step(phase, step, out.progress)

    @staticmethod
    def wants(step: int, total: int) -> bool:
        """Whether step ``step`` (1-based) of a phase of ``total`` steps is traced."""
        every = max(1, total // TRACE_RECORDS)
        return step % every == 0 or step == 1 or step == total

    def before_backward(self, resource_loss: torch.Tensor | None) -> None:
        """The resource loss's gradient on every ratio, the cost per element and the soft
        counts, from the current soft masks (no importance hook is on them)."""
        leaves = self._leaves()
        g_res = self._grad(resource_loss, leaves, retain=True)
        w, d = self.searcher.costs.masks("soft")
        counts = self._counts(w, d)
        dk = self._grad(torch.stack(counts).sum(), leaves) if counts else []
        cost = self.searcher.costs.soft()
        dc = self._grad(cost, leaves)
        self._pending = {"grad_resource": self._per_dim(g_res, leaves),
                         "soft": [_num(float(k.detach())) for k in counts],
                         "dk": self._per_dim(dk, leaves), "dc": self._per_dim(dc, leaves)}

    def after_step(self, phase: str, step: int, progress: float) -> None:
        """Write the step's line (the total gradient is the ratios' ``.grad`` now)."""
        pending, self._pending = self._pending, None
        if pending is None or not self.writes:
            return
        leaves = self._leaves()
        total = self._per_dim([p.grad for p in leaves], leaves)
        record: dict[str, Any] = {"phase": phase, "step": step, "progress": _num(progress)}
        record["a"] = [_num(self._value(ratio_leaf(g)[0], g)) for g in self.gates]
        record["kept"] = kept = [int(g.hard_mask().sum()) for g in self.gates]
        record["soft"] = pending["soft"]
        record["grad_resource"] = pending["grad_resource"]
        record["grad_task"] = [_num(t - r) for t, r in zip(total, pending["grad_resource"])]
        record["cost_per_element"] = [_num(c / k) if k else 0.0 for c, k in zip(pending["dc"], pending["dk"])]
        imp = [self._importance(g, k) for g, k in zip(self.gates, kept)]
        record["importance_mean"] = [m for m, _ in imp]
        record["importance_marginal"] = [k for _, k in imp]
        first = not self.path.exists()
        with open(self.path, "a", encoding="utf-8") as f:
            if first:
                f.write(json.dumps({"dims": self.dims}) + "\n")
            f.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ helpers
    def _leaves(self) -> list[torch.nn.Parameter]:
        seen: dict[int, torch.nn.Parameter] = {}
        for g in self.gates:
            leaf, _ = ratio_leaf(g)
            seen.setdefault(id(leaf), leaf)
        return list(seen.values())

    @staticmethod
    def _grad(value: torch.Tensor | None, leaves: list[torch.nn.Parameter],
              retain: bool = False) -> list[torch.Tensor | None]:
        wanted = [p for p in leaves if p.requires_grad]
        if value is None or not value.requires_grad or not wanted:
            return [None] * len(leaves)
        grads = iter(torch.autograd.grad(value, wanted, retain_graph=retain, allow_unused=True))
        return [next(grads) if p.requires_grad else None for p in leaves]

    def _value(self, tensor: torch.Tensor | None, gate: Any) -> float:
        if tensor is None:
            return 0.0
        _, i = ratio_leaf(gate)
        t = tensor.detach()
        return float(t.reshape(-1)[i] if i is not None else t.reshape(-1)[0])

    def _per_dim(self, grads: list[torch.Tensor | None], leaves: list[torch.nn.Parameter]) -> list[float]:
        by_leaf = {id(p): g for p, g in zip(leaves, grads)}
        return [_num(self._value(by_leaf.get(id(ratio_leaf(g)[0])), g)) for g in self.gates]

    def _counts(self, w: torch.Tensor, d: torch.Tensor) -> list[torch.Tensor]:
        """The soft count of every dim: its slice of the width (then depth) soft mask, summed."""
        out, off = [], 0
        n_width = len(self.searcher.gates.width)
        for j, size in enumerate(self.sizes):
            if j == n_width:
                off = 0
            src = w if j < n_width else d
            out.append(src[off:off + size].sum())
            off += size
        return out

    @staticmethod
    def _importance(gate: Any, kept: int) -> tuple[float, float]:
        """(mean, lowest kept unit's) raw importance of ``gate``, which keeps ``kept`` elements."""
        imp = getattr(gate, "importance", None)
        if imp is None or not imp.numel():
            return 0.0, 0.0
        imp = imp.detach().float().reshape(-1)
        step = int(getattr(gate, "step", 1))
        kept_units = max(1, -(-kept // step))
        order = torch.sort(imp, descending=True).values
        return _num(float(imp.mean())), _num(float(order[min(kept_units, imp.numel()) - 1]))


def read_trace(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(dims, records) of a run's ``search_trace.jsonl``; raises FileNotFoundError without one."""
    lines = (Path(run_dir) / TRACE_FILE).read_text(encoding="utf-8").splitlines()
    head = json.loads(lines[0])
    return head["dims"], [json.loads(line) for line in lines[1:] if line.strip()]
