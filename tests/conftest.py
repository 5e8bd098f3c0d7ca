"""Make helper modules in tests/ (e.g. ``zoo``) importable without a package __init__."""

import os
import sys

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


import copy  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from torch._tensor_str import PRINT_OPTS  # noqa: E402


@pytest.fixture(autouse=True)
def _keep_print_options():
    """Importing ultralytics sets global numpy/torch print options; give every test's
    successors (and the docstring examples) the options they started with."""
    np_options, torch_options = np.get_printoptions(), copy.copy(vars(PRINT_OPTS))
    yield
    np.set_printoptions(**np_options)
    vars(PRINT_OPTS).update(torch_options)
