#!/usr/bin/env bash
# Downloads (here, where Debian's archive is reachable) the .deb files of kiln's build
# dependencies into tests/gpu/debs/, for tests/gpu/run.sh to unpack on a GPU machine that can
# reach nothing. The folder is ignored by git; pass it to the device tool with carry.
#
#   bash tests/gpu/fetch_deps.sh      # ~9 MiB
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p debs
cd debs
# oneDNN's CMake config requires OpenCL (headers and libOpenCL.so) even for CPU use.
# apt-get download drops privileges to _apt, which needs to write here.
chmod 777 . 2>/dev/null || true
apt-get download libfmt9 libfmt-dev libdnnl2 libdnnl-dev ocl-icd-libopencl1 catch2 libcli11-dev \
  nlohmann-json3-dev libbenchmark1debian libbenchmark-dev zlib1g-dev opencl-c-headers ocl-icd-opencl-dev
ls -l
