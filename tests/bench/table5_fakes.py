"""Fake run records of ``python -m bench.llm_table5`` and the table they make, for the tests of how
that table pairs and compares its arms (``tests/bench/test_llm_*.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["record", "table5_markdown"]


def record(method: str, seed: int, ppl: float, steps: int = 70, **extra: Any) -> dict[str, Any]:
    """One arm's record at 80 % of a 100-parameter model: ``ppl`` after the finetune (twice that
    before), ``steps`` weight steps, plus ``extra`` fields (a DMS arm's structure, ...)."""
    return {"method": method, "target": 0.8, "seed": seed, "params_found": 80, "supernet": 100,
            "weight_steps": steps, "before": {"ppl": 2 * ppl}, "after": {"ppl": ppl}, "commit": "abc",
            "machine": "m", "cpus": 2, "task": "text", "quick": False,
            "args": {"batch_size": 4, "seq_len": 128, "test_limit": 8192}, **extra}


def table5_markdown(folder: Path, rows: list[dict[str, Any]]) -> str:
    """Write ``rows`` as the cache files of ``folder`` and return the table llm_table5 makes."""
    from bench import llm_table5

    for r in rows:
        (folder / f"{r['method']}_t0.8_s{r['seed']}.json").write_text(json.dumps(r))
    return llm_table5.write_markdown(folder, "t5", folder).read_text()
