"""Hidden setup of docs/library.md's "Under torch.distributed", run under torchrun with two
CPU processes (gloo): the process group, the same small ResNet and the same global batches on
every rank, and ``opt``, which the page creates after ``prepare`` (as in the example above
it): here built at its first use, over the prepared model's parameters (the gates are model
parameters by then)."""

import torch
import torch.distributed as dist

import dmscale as dms  # noqa: F401  (the block uses dms; the page imported it above)
from dmscale.tasks.models import ResNetCifar

dist.init_process_group("gloo")
torch.manual_seed(0)  # the same model and batches on every rank
model = ResNetCifar(depth=8, width=4, num_classes=10, in_channels=3)
x = torch.randn(1, 3, 16, 16)
global_batches = [(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))) for _ in range(3)]
total = len(global_batches)
task_loss = torch.nn.functional.cross_entropy


class _OptimizerAfterPrepare:
    def __getattr__(self, name):
        if "_opt" not in vars(self):
            self._opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return getattr(self._opt, name)


opt = _OptimizerAfterPrepare()
