#!/usr/bin/env bash
# Session 53, after run 373 (H100): the in-kernel quantizing (QX) lost everywhere and every 7B setting
# of run 373 had it on; programmatic edges were a no-op (capture already makes the cross-stream
# kernel edges programmatic). The same bundle (runs/run373_ab.diff), without QX: (b) at 4096² and
# 11008x4096 and the 7B mixed step at batch 32 for the store form, the streaming base and the
# priorities, two rounds each. Settings as run373.sh: store, priority, stream base, qx, prog edges.
#   run(command="bash bench/cuda/runs/run374.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
grep -qa BITDELTA_AB_PROG_EDGES .device/bin/bench_gpu_e2e || { echo "run374.sh: the bundle lacks the switch"; exit 1; }
L=$OUT/run374.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
left() { [ $(( $(date +%s) - t0 )) -gt $1 ] && { echo "left out (time): $2"; return 0; }; return 1; }
set_ab() {
  export BITDELTA_AB_TERMS_STORE=${1:0:1} BITDELTA_AB_ROUTE_PRIO=${1:1:1} BITDELTA_AB_STREAM_BASE=${1:2:1} \
    BITDELTA_AB_TERMS_QX=${1:3:1} BITDELTA_AB_PROG_EDGES=${1:4:1}
}
{
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  for ab in 00000 10000 00100 10100 12000 12100; do
    left 300 "mixed round $round $ab" && continue
    set_ab $ab
    echo "round $round ab $ab: $(timeout 60 .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case mixed 2>&1 |
      grep -E '^batch' | tr '\n' ' ')"
  done
done
for round in 1 2; do
  for ab in 00000 10000 12000 02000 11000; do
    left 420 "(b) round $round $ab" && continue
    set_ab $ab
    stamp "(b) round $round, ab $ab"
    timeout 60 .device/bin/bench_cuda_fused_linear --many-variants 4096 4096 11008 4096 > /tmp/b.log 2>&1
    grep -E "copy of|route, folded, graph of 20 |stream kernel base \| terms|alone, graph of 20 |after a norm" /tmp/b.log
  done
done
stamp done
} > $L 2>&1
cat $L
