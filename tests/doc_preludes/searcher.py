"""Hidden setup of docs/deploy.md: a ``searcher`` over a torchvision ResNet-18 after one training
step on random images (importance needs one), held to half its MACs (at 64 x 64 pixels) by the budget solver."""

import torch
import torchvision

import dmscale as dms

torch.manual_seed(0)
_model = torchvision.models.resnet18(num_classes=10)
searcher = dms.prepare(_model, torch.randn(1, 3, 64, 64), dms.SearchConfig(resource="macs", target=0.5))
_loss = torch.nn.functional.cross_entropy(_model(torch.randn(4, 3, 64, 64)), torch.randint(0, 10, (4,)))
(_loss + searcher.resource_loss(progress=1.0)).backward()
torch.optim.SGD(_model.parameters(), lr=0.01).step()
searcher.meet_target()
del _model, _loss
