#!/usr/bin/env bash
# On the GPU machine: builds the CUDA backend alone (BITDELTA_CUDA_ONLY: that machine lacks our Debian
# -dev packages), runs the gpu-labelled tests and the fused-linear benchmark, and writes the logs and
# the results table under OUT_DIR.  Usage: tools/gpu_run.sh OUT_DIR [--quick]
# Environment: BITDELTA_BENCH=0 skips the benchmark; BITDELTA_NCU=0 skips the ncu profile of the decode
# kernels (8192x8192, cases a and b).
set -uo pipefail
out=${1:?usage: tools/gpu_run.sh OUT_DIR [--quick]}
quick=${2:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
build=${BITDELTA_GPU_BUILD:-build-gpu}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  nvcc --version | tail -2
  cmake --version | head -1
  g++ --version | head -1
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

tests=ON
if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBITDELTA_CUDA_ONLY=ON \
      -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DCMAKE_CUDA_FLAGS="--threads=0" >"$out/configure.log" 2>&1; then
  # Without OpenBLAS's cblas.h the CPU reference (and so the test) cannot build: benchmark alone.
  echo "configure with tests failed (see configure.log); building the benchmark alone"
  tests=OFF
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBITDELTA_CUDA_ONLY=ON -DBITDELTA_BUILD_TESTS=OFF \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DCMAKE_CUDA_FLAGS="--threads=0" >>"$out/configure.log" 2>&1 ||
    { tail -30 "$out/configure.log"; exit 1; }
fi
if ! cmake --build "$build" -j "$(nproc)" >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
grep -i -E "warning|spill" "$out/build.log" | head -5

status=0
if [ "$tests" = ON ]; then
  ctest --test-dir "$build" -L gpu -V >"$out/test.log" 2>&1 || status=1
  grep -E "FAIL|checks passed|tests passed|tests failed" "$out/test.log" | head -20
else
  echo "gpu tests NOT built (no cblas.h)" | tee "$out/test.log"
  status=1
fi

[ "${BITDELTA_BENCH:-1}" = 1 ] || exit $status
"$build/src/backend/cuda/bench_cuda_fused_linear" $quick >"$out/bench.log" 2>&1 || status=1
cp "$out/bench.log" "$out/results.txt"
# Hardware counters of the decode kernels (8192x8192: 1 row 1 variant, then 16 rows 16 variants).
if [ "${BITDELTA_NCU:-1}" = 1 ] && command -v ncu >/dev/null; then
  ncu --clock-control none -k regex:decode_kernel --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section WarpStateStats --section LaunchStats \
    "$build/src/backend/cuda/bench_cuda_fused_linear" --profile >"$out/ncu.txt" 2>&1 || echo "ncu failed (see ncu.txt)"
fi
cat "$out/bench.log"
exit $status
