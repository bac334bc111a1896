#!/usr/bin/env bash
# The GPU check, one command: builds kiln with CUDA, runs the whole test suite (the device tests
# run instead of skipping), then the GPU benchmarks (bench/pytorch_cuda.py for PyTorch's figures,
# then bench/bench_cuda against them), and writes logs and a summary table into OUT_DIR.
#
#   bash tests/gpu/fetch_deps.sh                 # first, where Debian's archive is reachable
#   bash tests/gpu/run.sh OUT_DIR                # then on the GPU machine (tests/gpu/debs carried)
#   KILN_GPU_DEPS=debs KILN_CUDA_EMULATOR=1 KILN_GPU_BENCH_SCALE=0.0001 bash tests/gpu/run.sh OUT_DIR
#                                                # the same without a GPU: cuda:0 is the emulator
#
# Build dependencies: the system's packages when CMake finds them; otherwise (the GPU image has
# none of them and can install nothing) the .deb files in tests/gpu/debs, unpacked into a private
# prefix. KILN_GPU_DEPS=debs forces the prefix (to check that path on a machine that has them).
#
# Benchmarks: KILN_GPU_BENCH_SCALE (default 1: the issue's sizes) and KILN_GPU_BENCH_REPS
# (default 20) are passed to both programs as --scale and --reps; KILN_GPU_PYTHON (default
# python3) is the interpreter that imports torch; KILN_GPU_BENCH=0 skips the benchmarks,
# KILN_GPU_TESTS=0 skips the test suite (to rerun the benchmarks alone in a short slot). Every
# step that fails or times out (PyTorch 120 s, bench_cuda 180 s) gets a row saying so; the exit
# status is the test suite's alone.
set -uo pipefail
OUT=${1:?usage: bash tests/gpu/run.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
START=$(date +%s)
JOBS=$(nproc)
BUILD=build-gpu
summary=()
# What comes back from the GPU machine is at most 8 files: the summary (rewritten at every row,
# so a run cut short still reports what it got) and one archive of every log.
SUMMARY="$OUT/summary.md"
LOGS=$(mktemp -d /tmp/kiln-gpu-logs.XXXXXX)
row() {
  summary+=("| $1 | $2 |")
  printf '%s\n' "| check | result |" "|---|---|" "${summary[@]}" > "$SUMMARY"
  tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
}

# 1. The machine.
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi > "$LOGS/gpu.txt" 2>&1
  row "GPU" "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
else
  echo "nvidia-smi not found" > "$LOGS/gpu.txt"
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
    printf '%s\n' "| check | result |" "|---|---|" "${summary[@]}" | tee "$SUMMARY"
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
if cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKILN_BUILD_BENCH=OFF > "$LOGS/build.log" 2>&1 &&
   cmake --build "$BUILD" -j"$JOBS" >> "$LOGS/build.log" 2>&1; then
  row "build" "ok ($(grep -ao 'CUDA toolkit [0-9.]* found' "$LOGS/build.log" | head -1 || echo 'no CUDA toolkit'))"
else
  row "build" "FAILED (build.log)"
  tail -30 "$LOGS/build.log"
  printf '%s\n' "| check | result |" "|---|---|" "${summary[@]}" | tee "$SUMMARY"
  exit 1
fi

# 4. The whole suite (device tests included), then the CUDA cases alone, verbosely.
tests_rc=0 cuda_rc=0
if [[ ${KILN_GPU_TESTS:-1} == 0 ]]; then
  row "test suite" "skipped (KILN_GPU_TESTS=0)"
else
  ctest --test-dir "$BUILD" -j"$JOBS" --output-on-failure > "$LOGS/tests.log" 2>&1
  tests_rc=$?
  row "test suite" "$(grep -aE 'tests passed' "$LOGS/tests.log" | tail -1)"
  KILN_CACHE_DIR="$BUILD/kernel-cache" "$BUILD/tests/kiln_tests" "[cuda]" --success > "$LOGS/cuda_tests.log" 2>&1
  cuda_rc=$?
  row "[cuda] cases" "$(grep -aE '^(All tests passed|test cases:)' "$LOGS/cuda_tests.log" | tail -1)"
  # Offloaded activations: copies on the second stream, joined by events (jit/offload.h).
  KILN_CACHE_DIR="$BUILD/kernel-cache" "$BUILD/tests/kiln_tests" "[offload]" > "$LOGS/offload_tests.log" 2>&1 || cuda_rc=1
  row "[offload] cases" "$(grep -aE '^(All tests passed|test cases:)' "$LOGS/offload_tests.log" | tail -1)"
  row "NCCL (world of one)" "$(grep -aA3 'NCCL all-reduces' "$LOGS/cuda_tests.log" | grep -aoE 'SKIPPED[^"]*|PASSED|FAILED' | head -1)"
  # Two processes on the one GPU: NCCL refuses two ranks on one device, so this checks that the
  # collectives then take the host path (MPI) and agree. Needs OpenMPI on the GPU machine.
  if command -v mpirun >/dev/null 2>&1 && grep -q "MPI .* found" "$LOGS/build.log"; then
    KILN_CACHE_DIR="$BUILD/kernel-cache" KILN_LOG=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      timeout 300 mpirun --oversubscribe -np 2 "$BUILD/tests/kiln_tests" "[distributed]" > "$LOGS/mpi_gpu.log" 2>&1
    row "2 processes on one GPU" "exit $?; $(grep -aE '^(All tests passed|test cases:)' "$LOGS/mpi_gpu.log" | tail -1)"
  else
    row "2 processes on one GPU" "skipped (no OpenMPI on this machine)"
  fi
  row "NVRTC" "$(grep -ao 'NVRTC [0-9.]*: [0-9]* kernels[^;]*' "$LOGS/cuda_tests.log" | head -1)"
  row "device cases skipped for want of a GPU" "$(grep -ac 'SKIPPED: no CUDA' "$LOGS/cuda_tests.log") (0 expected on a GPU)"
fi

# 5. GPU benchmarks. bench_cuda is built into the same tree (only its own file compiles; Google
# Benchmark stays optional). PyTorch runs first, in its own process, so that bench_cuda can print
# the kiln/PyTorch ratios; each program is killed at its time limit and leaves a row either way.
# "What happened" for an exit status: timeout(1) answers 124 (137 after its KILL).
outcome() {
  case $1 in
    0) echo "ok" ;;
    124|137) echo "TIMED OUT after $2 s" ;;
    *) echo "FAILED (exit $1)" ;;
  esac
}
# One summary row per figure of bench_cuda.json, as "name<TAB>text" lines.
bench_rows() {
  python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
def num(v):
    return "-" if v is None else f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"
for f in d["figures"]:
    if f["error"]:
        text = "ERROR: " + f["error"][:300]
    else:
        text = f"{num(f['value'])} {f['unit']}"
        if f["baseline"] is not None:
            text += f" vs {f['baseline_name']} {num(f['baseline'])} = {f['ratio']:.2f}x"
        text += f" (target >= {f['target']:.2f}x): {f['result']}"
        if f["pytorch"] is not None and f["baseline_name"] != "PyTorch":
            text += f"; PyTorch {num(f['pytorch'])}"
        if f["note"]:
            text += f"; {f['note']}"
    text = text.replace("\n", " ").replace("\t", " ").replace("|", "/")  # one table cell
    print(f"bench: {f['name']}\t{text}")
if not d.get("complete", True):
    print("bench: incomplete\tthe run stopped before its last figure (bench_cuda.log)")
PY
}
if [[ ${KILN_GPU_BENCH:-1} == 0 ]]; then
  row "GPU benchmarks" "skipped (KILN_GPU_BENCH=0)"
else
  SCALE=${KILN_GPU_BENCH_SCALE:-1}
  REPS=${KILN_GPU_BENCH_REPS:-20}
  bench_built=0
  if cmake -S . -B "$BUILD" -DKILN_BUILD_BENCH=ON > "$LOGS/bench_build.log" 2>&1 &&
     cmake --build "$BUILD" -j"$JOBS" --target bench_cuda >> "$LOGS/bench_build.log" 2>&1; then
    bench_built=1
    row "bench_cuda build" "ok"
  else
    row "bench_cuda build" "FAILED (bench_build.log)"
  fi

  rm -f "$LOGS/pytorch_cuda.json" "$LOGS/bench_cuda.json"
  timeout -k 10 120 "${KILN_GPU_PYTHON:-python3}" -u bench/pytorch_cuda.py --scale "$SCALE" --reps "$REPS" --json "$LOGS/pytorch_cuda.json" \
    > "$LOGS/pytorch_cuda.log" 2>&1
  torch_rc=$?
  row "PyTorch side (pytorch_cuda.py)" "$(outcome $torch_rc 120) (pytorch_cuda.log): $(grep -aE '^(PyTorch |pytorch_cuda: )' "$LOGS/pytorch_cuda.log" | head -1 | cut -c1-200)"

  if [[ $bench_built == 1 ]]; then  # never a stale binary from an earlier build
    KILN_CACHE_DIR="$BUILD/kernel-cache" timeout -k 10 180 "$BUILD/bench/bench_cuda" --scale "$SCALE" --reps "$REPS" \
      --json "$LOGS/bench_cuda.json" --pytorch-json "$LOGS/pytorch_cuda.json" > "$LOGS/bench_cuda.log" 2>&1
    bench_rc=$?
    row "bench_cuda" "$(outcome $bench_rc 180) (bench_cuda.log): $(grep -aE '^bench_cuda' "$LOGS/bench_cuda.log" | head -1 | cut -c1-200)"
    if [[ -f $LOGS/bench_cuda.json ]] && bench_rows "$LOGS/bench_cuda.json" > "$LOGS/bench_rows.txt" 2>> "$LOGS/bench_cuda.log"; then
      while IFS=$'\t' read -r name text; do row "$name" "$text"; done < "$LOGS/bench_rows.txt"
    else
      row "bench figures" "none readable (bench_cuda.log)"
    fi
  else
    row "bench_cuda" "not run: not built"
  fi
fi
row "time" "$(( $(date +%s) - START )) s"

printf '%s\n' "| check | result |" "|---|---|" "${summary[@]}" | tee "$SUMMARY"
[[ $tests_rc == 0 && $cuda_rc == 0 ]]
