#!/usr/bin/env bash
# Session 57: why a variant's 512-token prompt costs more on H100s than on the H200 (TTFT p50 base
# 15.1 ms, variants 17.9-18.0 on run 387's H100; 14.9 and 15.8-16.0 on run 376's H200). ncu times every
# kernel of the first prompt of "batch 1, base" and of "batch 1, one variant" (bench_gpu_e2e
# --profile-what prompt); tools/ncu_sum.py sums them per kernel. The bundle: tools/device_bundle.sh.
#   run(command="bash bench/cuda/runs/run390.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run390.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for c in base "one variant"; do
  f=$OUT/prompt_${c// /_}.csv
  timeout 200 ncu --profile-from-start off --csv --page raw --metrics gpu__time_duration.sum \
    .device/bin/bench_gpu_e2e /tmp/l7b --decode 4 --profile-case "batch 1, $c" --profile-what prompt > $f 2> /tmp/ncu.err
  echo "== batch 1, $c: rc $?"; tail -2 /tmp/ncu.err
  python3 tools/ncu_sum.py $f | head -25
done
date -u
} > $L 2>&1
cat $L
