"""bench/deploy_traffic.py (issue 29): what an export at half the MACs still moves. The counts
are exact on a known network, and width pruning shrinks the activations far less than the MACs
(the reason an export at half the MACs is not twice as fast where a GPU is bound by memory)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
from bench import deploy_traffic  # noqa: E402


def test_activation_elements_count_every_leaf_output_once():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 3)))
    assert deploy_traffic.activation_elements(net, torch.ones(2, 4)) == 2 * 8 + 2 * 8 + 2 * 3


def test_half_the_macs_keeps_about_two_thirds_of_the_activations():
    build, _ = deploy_traffic.dl.models()["resnet18 (torchvision)"]
    row = deploy_traffic.measure("resnet18 (torchvision)", build, 64)
    assert abs(row["macs_ratio"] - 0.5) < 0.01
    # widths r c: MACs ~ r^2, outputs ~ r; measured 0.649 at 96 px
    assert 0.6 < row["activations_ratio"] < 0.75, row
    table = deploy_traffic.render({"models": {"resnet18 (torchvision)": row}})
    assert f"| resnet18 (torchvision) | 64 px | {row['macs_ratio']:.3f} |" in table
