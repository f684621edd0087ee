#!/usr/bin/env bash
# Here (the CPU machine, nvcc present): builds the CUDA-enabled binaries in build-cuda/ and bundles
# them, with the Debian libraries the GPU machine lacks, into .device/ (git-ignored) for
# tools/gpu_run.sh to run there (pass `.device` in the device tool's carry). The CPU tests and the
# CPU linear benchmark go too: the GPU host's Xeon has AVX-512 and AVX512-BF16, which this machine
# lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BITDELTA_CUDA_BUILD:-build-cuda}
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBITDELTA_CUDA=ON -DCMAKE_CUDA_FLAGS="--threads=0"
fi
targets=(bitdelta bitdelta_tests bench_linear bitdelta_gpu_tests bench_gpu_e2e bench_gpu_attention make_synthetic test_cuda_fused_linear
         bench_cuda_fused_linear bench_mma_rates bench_b1_delta)
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
rm -rf .device/bin .device/lib
mkdir -p .device/bin .device/lib
for t in "${targets[@]}"; do
  f=$(find "$build" -name "$t" -type f -perm -u+x | head -1)
  cp "$f" .device/bin/
  strip .device/bin/"$t"
done
# Libraries from our Debian -dev packages that Ubuntu's GPU image does not have (OpenBLAS, OpenSSL,
# zlib and CUDA's own libraries are there).
for l in libcpp-httplib.so.0.11 libsentencepiece.so.0 libxxhash.so.0 libbrotlicommon.so.1 libbrotlidec.so.1 \
         libbrotlienc.so.1 libbenchmark.so.1debian; do
  cp -L "/lib/x86_64-linux-gnu/$l" .device/lib/
done
du -sh .device
