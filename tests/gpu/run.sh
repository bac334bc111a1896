#!/usr/bin/env bash
# The GPU check, one command: builds kiln with CUDA, runs the whole test suite (the device tests
# run instead of skipping), and writes logs and a summary table into OUT_DIR.
#
#   bash tests/gpu/fetch_deps.sh                 # first, where Debian's archive is reachable
#   bash tests/gpu/run.sh OUT_DIR                # then on the GPU machine (tests/gpu/debs carried)
#
# Build dependencies: the system's packages when CMake finds them; otherwise (the GPU image has
# none of them and can install nothing) the .deb files in tests/gpu/debs, unpacked into a private
# prefix. KILN_GPU_DEPS=debs forces the prefix (to check that path on a machine that has them).
# What exists so far is discovery, device memory, copies, and CUDA kernels compiled by NVRTC for
# the present GPU; launching kernels (and so the CUDA op comparisons and the GPU benchmarks of
# issue 5) comes next, and the summary says so.
set -uo pipefail
OUT=${1:?usage: bash tests/gpu/run.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
START=$(date +%s)
JOBS=$(nproc)
BUILD=build-gpu
summary=()
row() { summary+=("| $1 | $2 |"); }

# 1. The machine.
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi > "$OUT/gpu.txt" 2>&1
  row "GPU" "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
else
  echo "nvidia-smi not found" > "$OUT/gpu.txt"
  row "GPU" "none (nvidia-smi not found)"
fi

# 2. Build dependencies.
PREFIX=/tmp/kiln-gpu-deps
use_debs=${KILN_GPU_DEPS:-auto}
if [[ $use_debs == auto ]]; then
  use_debs=system
  [[ -f /usr/lib/x86_64-linux-gnu/cmake/dnnl/dnnl-config.cmake && -f /usr/include/catch2/catch.hpp ]] || use_debs=debs
fi
if [[ $use_debs == debs ]]; then
  if ! ls tests/gpu/debs/*.deb >/dev/null 2>&1; then
    row "result" "FAILED: no build dependencies (run tests/gpu/fetch_deps.sh and carry tests/gpu/debs)"
    printf '%s\n' "| check | result |" "|---|---|" "${summary[@]}" | tee "$OUT/summary.md"
    exit 1
  fi
  rm -rf "$PREFIX" && mkdir -p "$PREFIX"
  for f in tests/gpu/debs/*.deb; do dpkg -x "$f" "$PREFIX"; done
  # zlib1g-dev's libz.so points at the archive's libz.so.1.x.y; use whatever libz.so.1 is here.
  for d in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu; do
    [[ -e $d/libz.so.1 ]] && ln -sf "$d/libz.so.1" "$PREFIX/usr/lib/x86_64-linux-gnu/libz.so" && break
  done
  export CMAKE_PREFIX_PATH="$PREFIX/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export CPATH="$PREFIX/usr/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
row "build dependencies" "$use_debs"

# 3. Build with CUDA.
if cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKILN_BUILD_BENCH=OFF > "$OUT/build.log" 2>&1 &&
   cmake --build "$BUILD" -j"$JOBS" >> "$OUT/build.log" 2>&1; then
  row "build" "ok ($(grep -ao 'CUDA toolkit [0-9.]* found' "$OUT/build.log" | head -1 || echo 'no CUDA toolkit'))"
else
  row "build" "FAILED (build.log)"
  tail -30 "$OUT/build.log"
  printf '%s\n' "| check | result |" "|---|---|" "${summary[@]}" | tee "$OUT/summary.md"
  exit 1
fi

# 4. The whole suite (device tests included), then the CUDA cases alone, verbosely.
ctest --test-dir "$BUILD" -j"$JOBS" --output-on-failure > "$OUT/tests.log" 2>&1
tests_rc=$?
row "test suite" "$(grep -aE 'tests passed' "$OUT/tests.log" | tail -1)"
KILN_CACHE_DIR="$BUILD/kernel-cache" "$BUILD/tests/kiln_tests" "[cuda]" --success > "$OUT/cuda_tests.log" 2>&1
cuda_rc=$?
row "[cuda] cases" "$(grep -aE '^(All tests passed|test cases:)' "$OUT/cuda_tests.log" | tail -1)"
row "NVRTC" "$(grep -ao 'NVRTC [0-9.]*: [0-9]* kernels[^;]*' "$OUT/cuda_tests.log" | head -1)"
row "device cases skipped for want of a GPU" "$(grep -ac 'SKIPPED: no CUDA' "$OUT/cuda_tests.log") (0 expected on a GPU)"
row "CUDA ops and GPU benchmarks" "not built yet: the executor does not launch CUDA kernels"
row "time" "$(( $(date +%s) - START )) s"

printf '%s\n' "| check | result |" "|---|---|" "${summary[@]}" | tee "$OUT/summary.md"
[[ $tests_rc == 0 && $cuda_rc == 0 ]]
