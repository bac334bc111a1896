#!/usr/bin/env bash
# The install check (ctest: install.public_headers_only): installs the kiln build in <build-dir>
# into a fresh prefix, then builds tests/install (train_tiny.cpp) against that prefix alone with
# find_package(kiln), with oneDNN's and CUDA's headers replaced by #error stubs, and runs it.
# Fails if a private header was installed, if a public header includes a library's header, or
# if the installed kilnConfig.cmake does not bring the static library's link dependencies.
# With "build-tree" as the fourth argument (ctest: install.build_tree) it builds the same program
# against the build tree itself (-Dkiln_DIR=<build-dir>, nothing installed).
#
#   tests/install/run.sh <kiln-build-dir> <scratch-dir> <c++-compiler> [install|build-tree]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$1 work=$2 cxx=$3 mode=${4:-install}

rm -rf "$work"
mkdir -p "$work"
if [ "$mode" = build-tree ]; then
  cmake -S "$here" -B "$work/build" -Dkiln_DIR="$build" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >/dev/null
  cmake --build "$work/build" -j2
  "$work/build/train_tiny"
  exit 0
fi
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null

# Private headers stay out of the install.
for private in backends jit/kernel_ir.h jit/index_expr.h jit/schedule.h jit/executor.h memory/planner.h; do
  if [ -e "$prefix/include/kiln/$private" ]; then
    echo "install check: private $private was installed" >&2
    exit 1
  fi
done

# Library headers a public kiln header must not include: stubs that stop the compile.
poison=$work/poison
for header in dnnl.h dnnl.hpp oneapi/dnnl/dnnl.h oneapi/dnnl/dnnl.hpp; do
  mkdir -p "$(dirname "$poison/$header")"
  echo "#error \"oneDNN header included by a public kiln header\"" >"$poison/$header"
done
for header in cuda.h cuda_runtime.h cuda_runtime_api.h cublasLt.h cublas_v2.h nvrtc.h cudnn.h; do
  echo "#error \"CUDA header included by a public kiln header\"" >"$poison/$header"
done

cmake -S "$here" -B "$work/build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DKILN_POISON_DIR="$poison" >/dev/null
cmake --build "$work/build" -j2
"$work/build/train_tiny"
