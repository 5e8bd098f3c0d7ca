"""Hidden setup of the training-loop examples (README quick start, docs/library.md): what the
page leaves to the reader's own code, with tiny data: a few steps on random images."""

import torch
import torchvision  # noqa: F401  (the pages import it too; here for fresh_resnet18)

torch.manual_seed(0)
total = 3                                             # training steps
images = torch.randn(4, 3, 64, 64)                    # one batch, reused every step
labels = torch.randint(0, 10, (4,))
task_loss = torch.nn.functional.cross_entropy
batches = [(images, labels)] * total                  # what `for images, labels in batches` reads
some_training_batches = [torch.randn(4, 3, 64, 64) for _ in range(2)]
fresh_resnet18 = torchvision.models.resnet18(num_classes=10)
