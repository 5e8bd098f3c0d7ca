"""DMSCallback under Lightning's ModelParallelStrategy (FSDP2) on CPU (gloo): run by
test_lightning_fsdp.py as ``torchrun --nproc_per_node 2 lightning_fsdp_script.py OUT_DIR``
(the module's ``configure_model`` shards its network with dmscale's ``shard_model``), and in one
process as ``main(OUT_DIR, devices=1)`` on the same global batch; each rank writes
OUT_DIR/<devices>-rank{r}.json and rank 0 the export to OUT_DIR/found-<devices>."""

from __future__ import annotations

import json
import os
import sys

import torch

import dmscale as dms

dms.ensure_torchvision()
import lightning as L  # noqa: E402

from dmscale.engine.fsdp import shard_model, sharded  # noqa: E402
from dmscale.integrations.lightning import DMSCallback  # noqa: E402
from torchrun_util import leave_process_group  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning_ddp_script import ResidualClassifier  # noqa: E402

GLOBAL_BATCH = 16


class ShardedClassifier(ResidualClassifier):
    """The residual classifier, its network sharded per block with FSDP2 (SGD: the weights of a
    sharded run equal one process's to float rounding; Adam would amplify that rounding)."""

    def configure_model(self) -> None:
        if sharded(self.net) is None and self.trainer.world_size > 1:
            shard_model(self.net, mesh=self.device_mesh["data_parallel"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(out: str, devices: int = 2) -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    g = torch.Generator().manual_seed(1)
    x = torch.randn(320, 16, generator=g)
    rank = int(os.environ.get("RANK", 0)) if devices > 1 else 0
    mine = torch.arange(rank, len(x), devices)  # each global batch of 16, split over the ranks
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[mine], x[mine, :4].argmax(1)),
                                         batch_size=GLOBAL_BATCH // devices)
    dms_cb = DMSCallback(search_config=dms.SearchConfig(resource="params", target=0.5, width_only_from=0.5),
                         example_inputs=torch.randn(2, 16, generator=g), submodule="net", structure_lr=0.05,
                         export_dir=os.path.join(out, f"found-{devices}"))
    strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1,
                                     process_group_backend="gloo") if devices > 1 else "auto"
    trainer = L.Trainer(max_steps=6, accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[dms_cb])
    module = ShardedClassifier()
    trainer.fit(module, loader)
    searcher = dms_cb.searcher
    handle = sharded(module.net)
    record = {"world": trainer.world_size, "sharded": bool(handle is not None and handle.active),
              "a": [float(v) for p in searcher.structure_parameters() for v in p.detach().reshape(-1)],
              "importance": [float(v) for b in searcher.gates.buffers() if b.is_floating_point()
                             for v in b.detach().reshape(-1)],
              "structure": searcher.structure()["width"], "depth_frozen": searcher.gates.depth_frozen,
              "resource_losses": dms_cb.resource_losses, "found": dms_cb.found_model is not None}
    with open(os.path.join(out, f"{devices}-rank{trainer.global_rank}.json"), "w") as f:
        json.dump(record, f)
    return record


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # (alive at exit, the sharded module aborted a rank now and then)
