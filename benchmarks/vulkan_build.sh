#!/usr/bin/env bash
# Build llama.cpp's tools with the Vulkan backend on Debian 12, to run on Mesa's lavapipe: a Vulkan device
# on the CPU, which llama.cpp lists as Vulkan0 and offloads to like a GPU, and which NVML cannot see.
#   bash benchmarks/vulkan_build.sh OUT_DIR [LLAMA_CPP_SRC]
# LLAMA_CPP_SRC: a llama.cpp source tree (default: $LLAMA_CPP_SOURCE, else the one vendored in the
# llama-cpp-python sdist of pyproject.toml's version, downloaded here). About 15 minutes on 2 idle cores,
# most of it the shaders. Builds llama-bench and llama-fit-params with their libraries beside them (found
# through $ORIGIN: the folder can be moved). Run the tools with:
#   GGML_VK_VISIBLE_DEVICES=0 OUT_DIR/llama-bench --list-devices
# (lavapipe is a CPU-type Vulkan device, which ggml-vulkan skips unless it is named).
# tests/test_vulkan.py runs on the result (OFFLOAD_TUNER_VULKAN_BIN=OUT_DIR); benchmarks/vulkan_journey.py
# calls this script and says what it costs.
set -euo pipefail
out=${1:?usage: vulkan_build.sh OUT_DIR [LLAMA_CPP_SRC]}
src=${2:-${LLAMA_CPP_SOURCE:-}}
here=$(cd "$(dirname "$0")/.." && pwd)
if ! command -v glslc >/dev/null || [[ ! -e /usr/include/vulkan/vulkan.h ]] || ! ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq mesa-vulkan-drivers libvulkan-dev glslc spirv-headers >/dev/null
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
if [[ -z $src ]]; then
  version=$(sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' "$here/pyproject.toml" | head -1)
  python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==${version}"
  tar -C "$tmp" -xzf "$tmp"/llama_cpp_python-*.tar.gz
  src=$(ls -d "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
fi
# The build says its commit (--version) as the same sources built into llama-cpp-python do: read it
# where the tree is (the sdist vendors llama.cpp as a git submodule), before copying it.
commit=$(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)
number=$(git -C "$src" rev-list --count HEAD 2>/dev/null || echo 0)
cp -r "$src" "$tmp/src"; src=$tmp/src
# Debian 12's Vulkan headers (1.3.239) lack VK_EXT_layer_settings, which ggml-vulkan uses only to pass
# settings to the validation layer: leave that structure out when the headers do not have it.
if ! grep -q LayerSettingsCreateInfoEXT /usr/include/vulkan/vulkan_structs.hpp 2>/dev/null; then
  python3 - "$src/ggml/src/ggml-vulkan/ggml-vulkan.cpp" <<'PY'
import re, sys
p = sys.argv[1]; s = open(p).read()
s = re.sub(r"    VkBool32 enable_best_practice = layer_settings;\n.*?vk::LayerSettingsCreateInfoEXT layer_setting_info\(settings\);\n", "", s, flags=re.S)
s = s.replace("layers, extensions, &layer_setting_info);", "layers, extensions);")
open(p, "w").write(s)
PY
fi
# GGML_NATIVE=OFF with explicit x86 features: a native build on a CPU with AMX compiles llama.cpp's AMX
# path, which crashes on some of those CPUs. CMAKE_BUILD_RPATH_USE_ORIGIN: the tools find their
# libraries beside them, not in this temporary build tree.
cmake -S "$src" -B "$tmp/build" -DGGML_VULKAN=ON -DGGML_RPC=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON -DLLAMA_BUILD_COMMIT="$commit" -DLLAMA_BUILD_NUMBER="$number" \
  -DCMAKE_BUILD_TYPE=Release >"$tmp/cmake.log" 2>&1 || { tail -20 "$tmp/cmake.log"; exit 1; }
# llama-bench and llama-fit-params only: llama-cli (VULKAN_TOOLS="llama-cli" adds it) pulls in llama.cpp's
# server and multimodal code, a third of the build; llama-fit-params parses llama-cli's and llama-server's
# flags with the same common parser.
cmake --build "$tmp/build" -j"$(nproc)" --target llama-bench llama-fit-params ${VULKAN_TOOLS:-} >"$tmp/build.log" 2>&1 || { tail -20 "$tmp/build.log"; exit 1; }
mkdir -p "$out"; cp -a "$tmp/build/bin/." "$out/"
echo "$out"
