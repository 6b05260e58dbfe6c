#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-speculative-simple and llama-bench (EAGLE-3 capable) from
# the llama-cpp-python source package on PyPI: no network beyond the package registry.
# Idempotent: each step (download, unpack, configure, build) is skipped when already done.
#
#   benchmarks/build_llamacpp.sh [DIR]      (default: $LLAMACPP_DIR, else ~/.cache/eagle3/llamacpp)
#
# Prints the source tree (for `--llama-cpp` / EAGLE3_LLAMA_CPP: it holds convert_hf_to_gguf.py and
# build/bin) and the binaries. About 13 CPU-minutes with 2 cores.
# Environment: LLAMACPP_VERSION (default 0.3.36, the version checked here),
# JOBS (default 2), NICE (default 19: the build yields to everything else), PIP (default pip),
# NATIVE (auto: -march=native unless the CPU has AMX, see below).
# Converting models needs a python with torch, transformers, numpy, sentencepiece, safetensors.
set -euo pipefail

[[ ${1:-} == -h || ${1:-} == --help ]] && { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0; }
DIR=${1:-${LLAMACPP_DIR:-$HOME/.cache/eagle3/llamacpp}}
VERSION=${LLAMACPP_VERSION:-0.3.36}
JOBS=${JOBS:-2}
NICE=${NICE:-19}
PIP=${PIP:-pip}
TOOLS=(llama-server llama-speculative-simple llama-bench)

for tool in cmake ninja g++; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found: install it (apt-get install cmake ninja-build g++)" >&2; exit 1; }
done

mkdir -p "$DIR"
SDIST="$DIR/llama_cpp_python-$VERSION.tar.gz"
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [[ ! -f $SDIST ]]; then
  echo "downloading llama-cpp-python==$VERSION (source package) into $DIR" >&2
  "$PIP" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR" >&2
fi
if [[ ! -f $SRC/CMakeLists.txt ]]; then
  echo "unpacking $SDIST" >&2
  tar xzf "$SDIST" -C "$DIR"
fi
[[ -f $SRC/src/models/eagle3.cpp ]] || { echo "error: $SRC has no src/models/eagle3.cpp: this llama.cpp cannot serve EAGLE-3 drafts; use LLAMACPP_VERSION=0.3.36 or newer" >&2; exit 1; }
# CPU flags: -march=native, except where the CPU reports AMX (Xeon Sapphire Rapids and later):
# there ggml's AMX kernels die with "Illegal instruction" on q8_0 models when the (virtual) machine
# does not enable AMX state (seen here: llama-speculative-simple with a q8_0 target), so build for
# AVX2/AVX-512 without AMX. NATIVE=ON / NATIVE=OFF forces one or the other.
NATIVE=${NATIVE:-auto}
if [[ $NATIVE == auto ]]; then
  if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then NATIVE=OFF; else NATIVE=ON; fi
fi
CPU_FLAGS=(-DGGML_NATIVE=ON)
if [[ $NATIVE == OFF ]]; then
  CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
  if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    CPU_FLAGS+=(-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
  fi
fi
if [[ ! -f $SRC/build/build.ninja ]]; then
  nice -n "$NICE" cmake -S "$SRC" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${CPU_FLAGS[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF >&2
fi
nice -n "$NICE" ninja -C "$SRC/build" -j "$JOBS" "${TOOLS[@]}" >&2

echo "llama.cpp source (--llama-cpp / EAGLE3_LLAMA_CPP): $SRC"
for tool in "${TOOLS[@]}"; do
  [[ -x $SRC/build/bin/$tool ]] || { echo "error: $SRC/build/bin/$tool was not built" >&2; exit 1; }
  echo "$tool: $SRC/build/bin/$tool"
done
echo "converter: $SRC/convert_hf_to_gguf.py"
