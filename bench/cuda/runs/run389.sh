#!/usr/bin/env bash
# Session 57: the cold load of one 7B delta with its pinned buffer allocated whole by cudaHostAlloc
# before the fill (22c5f96, "alloc") against the buffer mapped at once, filled as the file pages in and
# pinned chunk by chunk on a thread beside (the working tree, "chunked"); four rounds alternated, each
# in its own process with the delta dropped from the page cache first. The chunked form's GPU tests
# first (the engine's loads and host-tier reloads against the CPU backend). Carry the bundle (22c5f96)
# and the two binaries built here (xz -c build-cuda/...):
#   run(command="bash bench/cuda/runs/run389.sh", carry=[".device/bundle.tar.xz", ".device/e2e_alloc.xz",
#       ".device/e2e_chunked.xz", ".device/gpu_tests_chunked.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
for f in e2e_alloc e2e_chunked gpu_tests_chunked; do xz -dc .device/$f.xz > .device/bin/$f && chmod +x .device/bin/$f; done
L=$OUT/run389.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader; nproc
.device/bin/gpu_tests_chunked > $OUT/gpu_tests.log 2>&1; echo "chunked gpu tests rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|engine:" $OUT/gpu_tests.log | head
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2 3 4; do
  for form in alloc chunked; do
    echo "round $round $form: $(timeout 60 stdbuf -oL .device/bin/e2e_$form /tmp/l7b --decode 4 --batch 1 2>&1 |
      grep -m3 -E 'disk read|cold load|floor:' | tr '\n' ' ')"
  done
done
date -u
} > $L 2>&1
cat $L
