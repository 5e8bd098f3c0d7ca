"""The README's quick start, runnable: DMS on a torchvision ResNet-18 for 8x8 digits.

    .venv/bin/python examples/quickstart.py --steps 200

Searches width and depth for a quarter of the MACs (DMS_np, no retraining here), meets the
budget exactly, exports, checks the export against the hardened supernet, re-estimates the
export's BatchNorm statistics, saves and reloads.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch import nn

import dmscale as dms
from dmscale.data.digits import digits_tensors

import torchvision  # noqa: E402  (after dmscale: see dmscale.core._compat)


def build() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(1, 64, 3, padding=1, bias=False)  # 1x8x8 inputs
    model.maxpool = nn.Identity()
    return model


def main(steps: int = 200, target: float = 0.25) -> dict[str, float]:
    x_train, y_train, x_test, y_test = digits_tensors()
    model = build()
    example = x_train[:1]
    searcher = dms.prepare(model, example, dms.SearchConfig(resource="macs", target=target))
    # SGD for the weights, Adam for the pruning ratios (annealed in the settle phase)
    opt = searcher.optimizer(torch.optim.SGD(searcher.model_parameters(), lr=0.05, momentum=0.9),
                             total_steps=steps)
    g = torch.Generator().manual_seed(0)
    model.train()
    for step in range(steps):
        idx = torch.randint(0, len(x_train), (64,), generator=g)
        task = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        loss = task + searcher.resource_loss(progress=opt.progress)
        opt.zero_grad()
        loss.backward()
        opt.step()
    searcher.meet_target()  # the hard structure just under the target
    model.eval()
    with torch.no_grad(), searcher.hardened():
        hard = model(x_test)
    small = searcher.export().eval()
    with torch.no_grad():
        out = small(x_test)
    torch.testing.assert_close(out, hard, atol=1e-4, rtol=1e-4)
    # BatchNorm statistics were collected under soft masks: re-estimate them for the export
    dms.recalibrate_batchnorm(small, (x_train[i:i + 64] for i in range(0, 640, 64)))
    with torch.no_grad():
        out = small(x_test)
    with tempfile.TemporaryDirectory() as d:
        dms.save(small, searcher.structure(), d)
        again = dms.load(build().eval(), d)
        with torch.no_grad():
            torch.testing.assert_close(again(x_test), out)
    counts = dms.count(small, example)
    result = {
        "macs": counts["macs"],
        "supernet_macs": searcher.supernet_cost,
        "target_macs": searcher.target_cost,
        "accuracy": float((out.argmax(1) == y_test).float().mean()),
    }
    dms.detach(model)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--target", type=float, default=0.25)
    args = parser.parse_args()
    r = main(args.steps, args.target)
    print(f"MACs {r['macs']:,} (target {r['target_macs']:,.0f}, supernet {r['supernet_macs']:,.0f}); "
          f"test accuracy {r['accuracy']:.1%} (searched weights, no retraining)")
