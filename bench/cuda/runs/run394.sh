#!/usr/bin/env bash
# Session 57. On an H200: run392.sh (the table). On any other card: the DRAM bytes each kernel of
# the first 512-token prompt reads, base and one variant (ncu gpu__time_duration.sum and
# dram__bytes_read.sum at the card's own clock, tools/ncu_sum.py): whether the variant's fused GEMMs
# (run 391: 1.28x the base's cuBLAS GEMMs per layer on an H100, little faster at the higher clock)
# read W more than once from DRAM.
#   run(command="bash bench/cuda/runs/run394.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash bench/cuda/runs/run392.sh; fi
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run394.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for c in "one variant" base; do
  f=$OUT/ncu_dram_${c// /_}.csv
  timeout 150 ncu --clock-control none --profile-from-start off --csv --page raw \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum \
    .device/bin/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, $c" --profile-what prompt > $f 2> /tmp/ncu.err
  echo "== ncu, batch 1, $c: rc $?"; tail -1 /tmp/ncu.err
  python3 tools/ncu_sum.py $f > /tmp/sum.txt; head -12 /tmp/sum.txt; tail -1 /tmp/sum.txt
done
date -u
} > $L 2>&1
cat $L
