"""Hidden setup of docs/recipes.md: the reader's image folder, tiny (``images/train/CLASS/*.jpg``,
8 per class, and ``images/val/CLASS/*.jpg``, 4 per class, 40 x 40 JPEGs), and ``resnet18.pth``,
a state dict with the keys and shapes of timm's pretrained ResNet-18 (random weights: the test
machine is offline). Nothing here imports dmscale: the page's last block checks that loading
the result does not."""

from pathlib import Path as _Path

import timm as _timm
import torch as _torch

from image_folders import make_image_folder as _make_image_folder

_make_image_folder(_Path("images"), n_train=16, n_val=8, classes=2, size=40)
_torch.manual_seed(0)
_torch.save(_timm.create_model("resnet18").state_dict(), "resnet18.pth")
del _Path, _timm, _torch, _make_image_folder
