#!/usr/bin/env bash
# Session 53. One bundle built with runs/run373_ab.diff (temporary switches), for (b) at 4096², where
# the route (cuBLAS base | memset, quantize_x, delta terms) is 1.29-1.31x its roofline on the H200:
# - BITDELTA_AB_TERMS_STORE=1: no memset node at the fork; the terms kernel writes its rows (y not
#   read); the join zeroes only rows no add_terms wrote (none in (b)). The same floats (0 + t = t).
# - BITDELTA_AB_TERMS_QX=1: no quantize_x launch either; the terms kernel's first blocks quantize x's
#   units (row, pair of blocks), one per half-warp, and publish each (a flag released), and its warps
#   wait for the units they read. The same bytes as quantize_x (the kernel checks compare them).
# - BITDELTA_AB_PROG_EDGES=1: after capture, every full-dependency edge from a kernel into a kernel
#   launched chained (the fork's and the join's, across streams) made programmatic.
# - BITDELTA_AB_ROUTE_PRIO 0/1/2 (run 372): the side stream / the main streams at the greatest
#   priority, graphs instantiated with per-node priorities.
# - BITDELTA_AB_STREAM_BASE=1: in the engine, the streaming kernel takes the route's base at N <= 4096
#   (the bench has it as its "stream kernel base | terms" rows).
# - BITDELTA_AB_STAGE_ALL=1 (run 372): the stage in every one-row launch (S), against H (committed).
# Every command has a time limit (the in-kernel quantizing's waits trap after about a second, so a
# fault there is an error, not a hang). Order: the GPU tests and kernel checks with the switches on;
# the bench's captured graphs' edges and node priorities (BITDELTA_GRAPH_EDGES); (b) at 4096² and
# 11008x4096, two rounds of seven settings; the 7B mixed step at batch 32, two rounds of six; the
# batch-1 step S against H; on an H200 three rounds of (a) at 4096² (the committed kernel).
#   run(command="bash bench/cuda/runs/run373.sh", carry=[".device/bundle.tar.xz"])
#   then: python3 bench/cuda/runs/run373_summary.py run373.log
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
grep -qa BITDELTA_AB_PROG_EDGES .device/bin/bench_gpu_e2e || { echo "run373.sh: the bundle lacks the switch"; exit 1; }
L=$OUT/run373.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
left() { [ $(( $(date +%s) - t0 )) -gt $1 ] && { echo "left out (time): $2"; return 0; }; return 1; }
# set_ab CODE: store, priority, stream base, terms qx, programmatic edges (one digit each)
set_ab() {
  export BITDELTA_AB_TERMS_STORE=${1:0:1} BITDELTA_AB_ROUTE_PRIO=${1:1:1} BITDELTA_AB_STREAM_BASE=${1:2:1} \
    BITDELTA_AB_TERMS_QX=${1:3:1} BITDELTA_AB_PROG_EDGES=${1:4:1}
}
{
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for ab in 10100 10111; do
  set_ab $ab
  stamp "gpu tests, ab $ab"
  timeout 120 .device/bin/bitdelta_gpu_tests > /tmp/gt.log 2>&1; echo "rc $?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" /tmp/gt.log | head -6
  { echo "== ab $ab"; cat /tmp/gt.log; } >> $OUT/gpu_tests.log
done
set_ab 10010
stamp "kernel tests, ab 10010"
timeout 150 .device/bin/test_cuda_fused_linear > /tmp/kt.log 2>&1; echo "rc $?"
grep -E "^FAIL" /tmp/kt.log | head -10; grep -E "terms beside|delta only" /tmp/kt.log | head -6; tail -1 /tmp/kt.log
for ab in 00000 10010 10011 11010; do  # edges and node priorities of the bench's graphs
  set_ab $ab
  stamp "graph edges, ab $ab"
  BITDELTA_GRAPH_EDGES=1 timeout 60 .device/bin/bench_cuda_fused_linear --many-variants 4096 4096 2>&1 |
    grep -vE '^4096x4096' > /tmp/ge.log
  grep -m1 -A20 'graph edges made' /tmp/ge.log
  { echo "== ab $ab"; cat /tmp/ge.log; } >> $OUT/graph_edges.txt
done
for round in 1 2; do
  for ab in 00000 10000 10010 10011 10001 11010 12010; do
    left 330 "(b) round $round $ab" && continue
    set_ab $ab
    stamp "(b) round $round, ab $ab"
    timeout 60 .device/bin/bench_cuda_fused_linear --many-variants 4096 4096 11008 4096 > /tmp/b.log 2>&1
    grep -E "copy of|route, folded, graph of 20 |stream kernel base \| terms|x quantized before, stream base|alone, graph of 20 |after a norm" /tmp/b.log
    [ $round = 1 ] && { [ $ab = 00000 ] || [ $ab = 10011 ]; } && cp /tmp/b.log $OUT/bench_b_$ab.log
  done
done
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  for ab in 00000 10010 10011 10110 10111 11111; do
    left 520 "mixed round $round $ab" && continue
    set_ab $ab
    echo "round $round ab $ab: $(timeout 60 .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case mixed 2>&1 |
      grep -E '^batch' | tr '\n' ' ')"
  done
done
set_ab 00000
for round in 1 2; do
  for s in 0 1; do
    left 555 "batch 1 round $round $s" && continue
    export BITDELTA_AB_STAGE_ALL=$s
    echo "round $round stage everywhere $s: $(timeout 60 .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 \
      --profile-case "batch 1" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
  done
done
unset BITDELTA_AB_STAGE_ALL
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then  # (a) at 4096², the committed form
  for round in 1 2 3; do
    left 575 "(a) round $round" && continue
    echo "-- (a) round $round"
    timeout 30 .device/bin/bench_cuda_fused_linear --one-row 4096 4096 > /tmp/a.log 2>&1
    grep -E "copy of|balanced, chain of 20 |after a norm|graph of 20" /tmp/a.log
  done
fi
stamp done
} > $L 2>&1
cat $L
