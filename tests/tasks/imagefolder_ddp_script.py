"""``dmscale search --task imagefolder`` as one rank of a torchrun job, recording what it saw:
run by test_imagefolder_torchrun.py as
``torchrun --nproc_per_node 2 imagefolder_ddp_script.py RECORD_DIR -- DMSCALE_ARGS...``.

Each rank writes ``RECORD_DIR/rank{r}.json``: the examples its batch sampler gave it per
``(seed, step)`` (the sampler runs in the training process; workers only decode), and the
shape and a hash of every tensor of each model the run saves, as ``"N:NAME"`` in the order
saved (on every rank: only rank 0 writes files)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]


def main(argv: list[str]) -> int:
    from dmscale.cli import main as dmscale_main
    from dmscale.data.order import StepBatchSampler
    from dmscale.run.context import RunContext

    record_dir, dmscale_args = Path(argv[0]), argv[argv.index("--") + 1:]
    seen: dict[str, list[int]] = {}
    saved: dict[str, dict[str, Any]] = {}
    items = StepBatchSampler.items

    def recording_items(self: StepBatchSampler, step: int) -> list[tuple[int, int]]:
        got = items(self, step)
        seen[f"{self.seed}/{step}"] = [i for i, _ in got]
        return got

    save_weights = RunContext.save_weights

    def recording_save(self: RunContext, model: Any, name: str) -> None:
        saved[f"{len(saved)}:{name}"] = {k: [list(v.shape), hashlib.sha256(v.detach().cpu().contiguous().numpy().tobytes()).hexdigest()]
                       for k, v in model.state_dict().items()}
        save_weights(self, model, name)

    StepBatchSampler.items = recording_items  # type: ignore[method-assign]
    RunContext.save_weights = recording_save  # type: ignore[method-assign]
    rc = dmscale_main(dmscale_args)
    record = {"rc": rc, "seen": seen, "saved": saved, "world": int(os.environ.get("WORLD_SIZE", "1"))}
    (record_dir / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
