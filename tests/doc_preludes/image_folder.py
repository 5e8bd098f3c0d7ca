"""Hidden setup of the tar-shard example (docs/cli.md): the reader's image folder, tiny:
``images/train/CLASS/*.jpg`` (8 per class) and ``images/val/CLASS/*.jpg`` (2 per class) in the
block's working directory."""

from pathlib import Path

from image_folders import make_image_folder

make_image_folder(Path("images"), n_train=16, n_val=4, classes=2, size=20)
