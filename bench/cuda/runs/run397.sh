#!/usr/bin/env bash
# Session 57, for a later session: why the fused prompt GEMM issues less often than cuBLAS (run 396's
# ncu call: layer 0's qkv, 12288 x 4096 at 512 rows, 93.9 against 73.2 us at the same 1.63 GHz, SM
# throughput 62% against 80%). ncu on that one launch of each, at the card's clock, with the warp
# state and scheduler sections and their details (stall reasons), and the instruction mix; run it on
# an H100 and on an H200 and compare. About 60 s after the 7B model is made.
#   run(command="bash bench/cuda/runs/run397.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run397.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for c in "one variant:fused_gemm" "base:nvjet"; do
  k=${c#*:} n=${c%:*}
  echo "== batch 1, $n: the first $k launch of the prompt"
  timeout 150 ncu --clock-control none --profile-from-start off -k regex:$k --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section InstructionStats --print-details all \
    .device/bin/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, $n" --profile-what prompt \
    > $OUT/ncu_$k.txt 2>&1
  # the sections after the speed of light (saved whole in ncu_$k.txt)
  grep -vE "^==PROF==|^ +-+ *$|^$" $OUT/ncu_$k.txt | grep -vE "^ +(OPT|INF|WRN) |^          [a-z]" |
    awk '/Section: /{on = /Scheduler|Warp State|Instruction/} on' | grep -vE "Table (Name|Description)" | head -100
done
date -u
} > $L 2>&1
cat $L
