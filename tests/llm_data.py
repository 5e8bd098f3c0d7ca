"""The offline copies of the standard LLM evaluation and instruction data (WikiText-2, PTB,
BoolQ, WinoGrande, ARC, Alpaca) that the tests read: ``$DMSCALE_LLM_DATA``, else
``shared/data/llm`` beside the checkout. The package ships none of them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

__all__ = ["LLM_DATA", "llm_data"]

LLM_DATA = Path(os.environ.get("DMSCALE_LLM_DATA")
                or Path(__file__).resolve().parents[2] / "shared" / "data" / "llm")


def llm_data() -> Path:
    """The data directory, or skip naming where it was looked for."""
    if not (LLM_DATA / "SHA256SUMS").is_file():
        pytest.skip(f"no LLM evaluation data at {LLM_DATA} (set DMSCALE_LLM_DATA)")
    return LLM_DATA
