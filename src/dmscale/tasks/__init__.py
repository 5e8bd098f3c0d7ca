"""Reference tasks for dmscale: plain PyTorch models used in examples and tests.

The models live in :mod:`dmscale.tasks.models`; import them from there.
"""

__all__: list[str] = []
