#!/usr/bin/env bash
# Session 55: the route's base through the streaming kernel in the 7B mixed step, side by side with
# cuBLAS (the bundle built from runs/run381_ab_stream_base.diff): BITDELTA_AB_STREAM_BASE=0 cuBLAS
# (committed), 1 the streaming kernel on its own grid, 2 on min(tiles, SMs / 2) blocks (run 378's
# timeline: only then do the two branches run at once; (b) 20.12 against 21.34 µs at 4096² on the H200).
#   run(command="bash bench/cuda/runs/run381.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
grep -qa BITDELTA_AB_STREAM_BASE .device/bin/bench_gpu_e2e || { echo "run381.sh: the bundle lacks the switch"; exit 1; }
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run381.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2 3; do
  for b in 32 16; do
    for ab in 0 1 2; do
      [ $(( $(date +%s) - t0 )) -gt 170 ] && { stamp "left out: round $round batch $b base $ab"; continue; }
      echo "round $round base $ab: $(BITDELTA_AB_STREAM_BASE=$ab timeout 40 .device/bin/bench_gpu_e2e /tmp/l7b \
        --decode 16 --batch $b --profile-case mixed 2>&1 | grep -E '^batch' | tr '\n' ' ')"
    done
  done
done
stamp done
} > $L 2>&1
cat $L
