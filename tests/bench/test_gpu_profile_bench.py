"""bench/gpu_profile.py: one profiled step's numbers, and no device waits reported off CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
from bench import gpu_profile  # noqa: E402


def test_a_profiled_step_reports_its_wall_and_host_time_and_top_operators() -> None:
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def step() -> None:
        lin(x).square().sum().backward()

    r = gpu_profile.profile_step(step, torch.device("cpu"), top=3)
    assert r["wall_ms"] > 0 and r["host_ms"] > 0 and r["kernels"] == 0 and r["device_ms"] is None
    assert len(r["by_time"]) == 3 and any(k == "aten::linear" for k, _, _ in r["by_count"] + r["by_time"])
    assert r["runtime"] == []  # no CUDA runtime calls on the CPU
    assert gpu_profile.synchronisations(step, torch.device("cpu")) == []
