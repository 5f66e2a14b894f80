#!/usr/bin/env bash
# Builds everything (C++ core, CUDA kernels, Python extension, C++ tests) and
# runs every test this host can run: the CPU tests always, the GPU suite when
# GPUs are visible (one rank per GPU, at least 4 ranks: with fewer GPUs the
# ranks share them; TURNOUT_TEST_RANKS sets the count). Installs what is
# missing, at pinned versions.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
py=${PYTHON:-python3}

missing=()
need_module() { "$py" -c "import $1" 2>/dev/null || missing+=("$2"); }
need_module torch torch==2.11.0
need_module numpy numpy==2.4.6
need_module pytest pytest==9.2.0
need_module nanobind nanobind==3.1.0
need_module scikit_build_core scikit-build-core==1.1.2
# The NVSHMEM transport's build (multi-host); found by CMake through this interpreter.
need_module nvidia.nvshmem nvidia-nvshmem-cu13==3.4.5
if ((${#missing[@]})); then
  echo "== installing ${missing[*]}"
  "$py" -m pip install --quiet --root-user-action=ignore "${missing[@]}"
fi

packages=()
command -v cmake >/dev/null || packages+=(cmake)
command -v g++ >/dev/null || packages+=(g++)
[ -e /usr/include/gtest/gtest.h ] || [ -e /usr/local/include/gtest/gtest.h ] || packages+=(libgtest-dev)
if ((${#packages[@]})); then
  if command -v apt-get >/dev/null && { apt-get update -qq && apt-get install -y -qq "${packages[@]}"; }; then :; else
    echo "== could not install ${packages[*]}: the C++ CPU tests may be skipped"
  fi
fi
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH

echo "== building (CUDA architectures: ${TURNOUT_CUDA_ARCHITECTURES:-90})"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
"$py" -m pip install --quiet --root-user-action=ignore --no-build-isolation --no-deps . \
  -Cbuild-dir=build/test \
  -Ccmake.define.TURNOUT_BUILD_TESTS=ON \
  -Ccmake.define.TURNOUT_CUDA_ARCHITECTURES="${TURNOUT_CUDA_ARCHITECTURES:-90}"

echo "== C++ tests (ctest)"
ctest --test-dir build/test --output-on-failure -j "$(nproc)"

echo "== Python tests (pytest)"
# From outside the checkout, so `import turnout` is the installed package.
(cd "$(mktemp -d)" && "$py" -m pytest "$root/tests/python" -q)

if "$py" -c "import sys, torch; sys.exit(torch.cuda.device_count() == 0)"; then
  echo "== GPU suite"
  "$py" tests/gpu/run.py
else
  echo "== no GPU visible: GPU suite not run"
fi
