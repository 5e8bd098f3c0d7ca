"""``python -m dmscale``: the ``dmscale`` command (see :mod:`dmscale.cli`)."""

import sys

from dmscale.cli import main

if __name__ == "__main__":
    sys.exit(main())
