#!/usr/bin/env bash
# Install (if needed) and run the whole test suite: unit tests and docstring examples.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/data -k idx`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest -q -x --durations=15 "$@"
