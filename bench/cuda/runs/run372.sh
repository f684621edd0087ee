#!/usr/bin/env bash
# Session 52. One bundle built with runs/run372_ab_prio_stage.diff (two temporary switches):
# 1. The route's stream priorities (never tried): BITDELTA_AB_ROUTE_PRIO 0 as committed, 1 the side
#    stream (zeroing, quantizing, delta terms) at the greatest priority, 2 the main streams (cuBLAS's
#    base) at it; graphs instantiated with per-node priorities. (b) at 4096² and 11008×4096 (graphs of
#    20) and the 7B step of 32 rows of 14 variants mixed, which takes the route; two rounds.
# 2. Whether 47a881b (no stage where a warp has one round, H) keeps the stage's gain in the 7B batch-1
#    step on an H100 (S was 0.5-1.7% faster than A there, part 50): BITDELTA_AB_STAGE_ALL=1 is S.
#   run(command="bash bench/cuda/runs/run372.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
grep -qa BITDELTA_AB_ROUTE_PRIO .device/bin/bench_gpu_e2e || { echo "run372.sh: the bundle lacks the switch"; exit 1; }
L=$OUT/run372.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  for prio in 0 1 2; do
    export BITDELTA_AB_ROUTE_PRIO=$prio
    stamp "round $round, route priority $prio"
    .device/bin/bench_cuda_fused_linear --many-variants 4096 4096 11008 4096 > /tmp/b.log 2>&1
    grep -E "copy of|route, folded, graph of 20 |after a norm, graph of 20 pairs less the norms  " /tmp/b.log
    .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case "14 variants mixed" 2>&1 | grep -E '^batch'
  done
done
unset BITDELTA_AB_ROUTE_PRIO
for round in 1 2 3; do
  for s in 0 1; do
    export BITDELTA_AB_STAGE_ALL=$s
    echo "round $round, stage everywhere $s: $(.device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case "batch 1" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
  done
done
stamp done
} > $L 2>&1
cat $L
