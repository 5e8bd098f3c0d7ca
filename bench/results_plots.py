"""One matplotlib plot per benchmark table whose per-run results are cached (bench/RESULTS.md).

    python -m bench.results_plots

Reads only the json caches the benchmark scripts write (nothing is re-run) and writes
``bench/results/<table>.png``:

* ``peers.png`` from ``peers.json`` (table 4): top-1 after finetuning per method and setting,
  mean ± std, seeds as dots, and beside it top-1 against the exported MACs (the Pareto view);
* ``budget.png`` from ``budget.json`` (table 6): exported MACs / target at the search's end
  and after the finish phase and budget solver, per target and r_c mode;
* ``yolo_table11.png`` from ``yolo_table11.json`` (table 11): mAP50-95 and MACs / YOLOv8n's per arm;
* ``schedule.png`` from ``schedule.json`` (table 7): MACs / target at the search's end and
  top-1 after retraining per r_t schedule arm, mean ± std, seeds as dots;
* ``search_overhead.png`` from ``search_overhead.json`` (table 8): DMS / plain step time
  (median, per-round quartiles) and peak memory per model;
* ``deploy_latency.png`` from ``deploy_latency.json`` (deployment latency): pruned / original
  latency per model, engine and batch size, next to the model's MACs ratio;
* ``llm_baselines.png`` from ``llm_baselines.json`` (table 5 analog): SmolLM2 held-out
  perplexity before / after the shared finetune per method and parameter target.

The gate table (``gates.png``) is drawn by ``bench/gates.py --table-only``. Tables with no
per-run cache (latency fit, SmolLM2) get no plot here; their markdown is the record.

Example:
    >>> sorted(PLOTS)
    ['budget', 'deploy_latency', 'llm_baselines', 'peers', 'schedule', 'search_overhead', 'yolo_table11']
"""

from __future__ import annotations

import json
import sys

from bench.lib.benchlib import RESULTS
from bench.lib.plots import PLOTS

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    for name, draw in PLOTS.items():
        cache = RESULTS / f"{name}.json"
        if not cache.exists():
            print(f"{name}: no cache {cache.name}, no plot (run its benchmark first)")
            continue
        print(f"wrote {draw(json.loads(cache.read_text()), RESULTS / f'{name}.png')}")


if __name__ == "__main__":
    main(sys.argv[1:])
