#!/usr/bin/env bash
# Install (if needed) and run the whole test suite: unit tests and docstring examples, then
# the wheel check (scripts/wheel_check.sh: the wheel installed outside the checkout runs the
# default job). Extra arguments go to pytest alone, e.g. `bash scripts/test.sh tests/data -k idx`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
if [[ $# -gt 0 ]]; then
    exec .venv/bin/python -m pytest -q -x --durations=15 "$@"
fi
.venv/bin/python -m pytest -q -x --durations=15
bash scripts/wheel_check.sh
