#!/usr/bin/env bash
# Here (the CPU machine, nvcc present): builds the CUDA-enabled binaries in build-cuda/ and bundles
# them, with the Debian libraries the GPU machine lacks, into .device/ (git-ignored) for
# tools/gpu_run.sh to run there (pass `.device` in the device tool's carry). With
# BITDELTA_BUNDLE_EXTRA=1 the CPU tests, the CPU linear benchmark (the GPU host's Xeon has AVX-512 and
# AVX512-BF16, which this machine lacks) and the mma-rate benchmarks go too. A device run carries at
# most 64 MiB with the tracked files, which the binaries alone (over 90 MB) would overfill: so they go
# xz-compressed into .device/bundle.tar.xz (about 6 MB), and a run carries only that file
# (carry [".device/bundle.tar.xz"]); gpu_run.sh unpacks it there. The bundle also holds, in
# .device/bin-ptx and .device/bin-ptx90, the engine and its GPU tests built with only the compute_80 or
# the compute_90 PTX (build-cuda-ptx/, build-cuda-ptx90/), for gpu_run.sh's "portable" stage.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BITDELTA_CUDA_BUILD:-build-cuda}
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBITDELTA_CUDA=ON -DCMAKE_CUDA_FLAGS="--threads=0"
fi
targets=(bitdelta bitdelta_gpu_tests bench_gpu_e2e bench_gpu_attention make_synthetic test_cuda_fused_linear
         bench_cuda_fused_linear)
if [ "${BITDELTA_BUNDLE_EXTRA:-0}" = 1 ]; then targets+=(bitdelta_tests bench_linear bench_mma_rates bench_b1_delta); fi
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
# The same engine with one PTX alone (BITDELTA_CUDA_PTX_ONLY=80 and 90), for gpu_run.sh's "portable"
# stage: on the H200 they run what 8.x GPUs and GPUs after Hopper run. BITDELTA_BUNDLE_PTX=0 skips
# them, for a run that needs only .device/bin (session 51, cold ccache: the normal build about 5 minutes,
# the two PTX builds 2.5 more, their C++ mostly ccache hits).
ptx_targets=(bitdelta bitdelta_gpu_tests test_cuda_fused_linear bench_gpu_e2e bench_cuda_fused_linear)
ptx_archs=(80 90)
[ "${BITDELTA_BUNDLE_PTX:-1}" = 0 ] && ptx_targets=() ptx_archs=()
for arch in "${ptx_archs[@]}"; do
  ptx_build=${build}-ptx$([ $arch = 80 ] || echo $arch)
  if [ ! -f "$ptx_build/CMakeCache.txt" ]; then
    cmake -S . -B "$ptx_build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBITDELTA_CUDA=ON -DBITDELTA_CUDA_PTX_ONLY=$arch \
      -DCMAKE_CUDA_FLAGS="--threads=0"
  fi
  cmake --build "$ptx_build" -j "$(nproc)" --target "${ptx_targets[@]}"
done
rm -rf .device/bin .device/bin-ptx .device/bin-ptx90 .device/lib
mkdir -p .device/bin .device/bin-ptx .device/bin-ptx90 .device/lib
copy_bins() {  # build dir, destination, targets...
  local from=$1 to=$2
  shift 2
  for t in "$@"; do
    f=$(find "$from" -name "$t" -type f -perm -u+x | head -1)
    cp "$f" "$to"/
    strip "$to/$t"
  done
}
copy_bins "$build" .device/bin "${targets[@]}"
if [ ${#ptx_archs[@]} -gt 0 ]; then
  copy_bins "${build}-ptx" .device/bin-ptx "${ptx_targets[@]}"
  copy_bins "${build}-ptx90" .device/bin-ptx90 "${ptx_targets[@]}"
fi
# Libraries from our Debian -dev packages that Ubuntu's GPU image does not have (OpenBLAS, OpenSSL,
# zlib and CUDA's own libraries are there).
for l in libcpp-httplib.so.0.11 libsentencepiece.so.0 libxxhash.so.0 libbrotlicommon.so.1 libbrotlidec.so.1 \
         libbrotlienc.so.1 libbenchmark.so.1debian libpcre2-8.so.0; do
  cp -L "/lib/x86_64-linux-gnu/$l" .device/lib/
done
# One xz stream with a dictionary larger than the binaries together: every binary links the same
# CUDA kernels, so each repeats most of the one before it. Multithreaded xz at -6 compresses 24 MB
# blocks apart with 8 MB dictionaries and finds none of that: 19.2 MB against 5.7 MB (session 42,
# the same files; 35-40 s on this machine's two cores against 18, 0.9 s to unpack; xz needs 128 MiB
# of memory for it).
tar -C .device -cf - bin bin-ptx bin-ptx90 lib | xz -T1 --lzma2=preset=9,dict=128MiB >.device/bundle.tar.xz
tracked=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
bundle=$(du -b .device/bundle.tar.xz | cut -f1)
echo ".device/bin + bin-ptx + bin-ptx90 + lib: $(du -sh .device/bin .device/bin-ptx .device/bin-ptx90 .device/lib | cut -f1 | tr '\n' ' '); .device/bundle.tar.xz: $((bundle >> 10)) KiB;" \
  "a run carrying it and the tracked files ($((tracked >> 20)) MiB) has $((((64 << 20) - tracked - bundle) >> 20)) MiB to spare"
