"""Imported at start-up by every Python process a multi-process test launches (this folder is
put on ``PYTHONPATH`` by :func:`torchrun_util.run_group`): SIGUSR1 makes the process print the
stacks of all its threads to stderr and go on, so a test that times out can show where each
launcher, rank and data-loader worker was waiting before it kills them."""

import faulthandler
import signal

faulthandler.register(signal.SIGUSR1, all_threads=True)
