#!/usr/bin/env bash
# Session 53. One bundle built with runs/run373_ab.diff (run 372's switches plus two), for (b) at
# 4096², where the route (cuBLAS base | memset, quantize_x, delta terms) is 1.29-1.31x its roofline:
# - BITDELTA_AB_TERMS_STORE=1: no memset node at the fork; the terms kernel writes its rows (y not
#   read); the join zeroes only rows no add_terms wrote (none in (b), where every row has a delta).
#   The same floats as the committed form (0 + t = t).
# - BITDELTA_AB_ROUTE_PRIO 0/1/2 (run 372): the side stream / the main streams at the greatest
#   priority, graphs instantiated with per-node priorities.
# - BITDELTA_AB_STREAM_BASE=1: in the engine, the streaming kernel takes the route's base at N <= 4096
#   (the bench has it as its "stream kernel base | terms" rows).
# - BITDELTA_AB_TERMS_QX=1: no quantize_x launch either; the terms kernel's first blocks quantize x's
#   units (row, pair of blocks), one per half-warp, and publish each (a flag released), and its warps
#   wait for the units they read. The same bytes as quantize_x (the kernel checks compare them).
# - BITDELTA_AB_STAGE_ALL=1 (run 372): the stage in every one-row launch (S), against H (committed).
# Every command has a time limit (the in-kernel quantizing's waits trap after about a second, so a
# fault there is an error, not a hang). Order: the tests with the switches on, the edges of the bench's captured graphs (BITDELTA_GRAPH_EDGES:
# does capture make the fork's edge programmatic once the memset is gone?), (b) at 4096² and 11008x4096
# (two rounds of store x prio),
# the 7B mixed step at batch 32 (two rounds), the batch-1 step S against H (two rounds), and on an
# H200 three rounds of (a) at 4096² (the committed kernel), for the median that part 52 asked for.
#   run(command="bash bench/cuda/runs/run373.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
grep -qa BITDELTA_AB_TERMS_QX .device/bin/bench_gpu_e2e || { echo "run373.sh: the bundle lacks the switch"; exit 1; }
L=$OUT/run373.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
left() { [ $(( $(date +%s) - t0 )) -gt $1 ] && { echo "left out (time): $2"; return 0; }; return 1; }
{
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for q in 0 1; do
  stamp "gpu tests, store 1, stream base 1, terms qx $q"
  BITDELTA_AB_TERMS_STORE=1 BITDELTA_AB_STREAM_BASE=1 BITDELTA_AB_TERMS_QX=$q timeout 120 .device/bin/bitdelta_gpu_tests \
    > $OUT/gpu_tests_qx$q.log 2>&1
  echo "rc $?"; grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" $OUT/gpu_tests_qx$q.log | head -10
done
stamp "kernel tests, store 1, terms qx 1"
BITDELTA_AB_TERMS_STORE=1 BITDELTA_AB_TERMS_QX=1 timeout 150 .device/bin/test_cuda_fused_linear > /tmp/kt.log 2>&1; echo "rc $?"
grep -E "^FAIL" /tmp/kt.log | head -10; grep -E "terms beside|delta only" /tmp/kt.log | head -6; tail -1 /tmp/kt.log
# The captured routes' edges (which are programmatic) and kernel nodes' priorities: as committed; no
# memset and no quantize_x; the same with the side stream at the greatest priority.
for spq in 000 101 111; do
  stamp "graph edges, store ${spq:0:1}, priority ${spq:1:1}, terms qx ${spq:2:1}"
  BITDELTA_GRAPH_EDGES=1 BITDELTA_AB_TERMS_STORE=${spq:0:1} BITDELTA_AB_ROUTE_PRIO=${spq:1:1} \
    BITDELTA_AB_TERMS_QX=${spq:2:1} timeout 60 .device/bin/bench_cuda_fused_linear --many-variants 4096 4096 2>&1 |
    grep -vE '^4096x4096' > $OUT/graph_edges_$spq.txt
  grep -A16 -m1 'graph edges' $OUT/graph_edges_$spq.txt
done
for round in 1 2; do
  for spq in 000 100 101 111 121 110; do  # store, priority, terms qx
    export BITDELTA_AB_TERMS_STORE=${spq:0:1} BITDELTA_AB_ROUTE_PRIO=${spq:1:1} BITDELTA_AB_TERMS_QX=${spq:2:1}
    stamp "(b) round $round, store ${spq:0:1}, priority ${spq:1:1}, terms qx ${spq:2:1}"
    timeout 60 .device/bin/bench_cuda_fused_linear --many-variants 4096 4096 11008 4096 > /tmp/b.log 2>&1
    grep -E "copy of|route, folded, graph of 20 |stream kernel base \| terms|x quantized before, stream base|alone, graph of 20 " /tmp/b.log
    [ $round = 1 ] && [ $spq = 000 ] && cp /tmp/b.log $OUT/bench_b_000.log
    [ $round = 1 ] && [ $spq = 101 ] && cp /tmp/b.log $OUT/bench_b_101.log
  done
done
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  for f in 0000 1000 1001 1011 1111 0010; do  # store, priority, stream base, terms qx
    left 500 "mixed round $round $f" && continue
    export BITDELTA_AB_TERMS_STORE=${f:0:1} BITDELTA_AB_ROUTE_PRIO=${f:1:1} BITDELTA_AB_STREAM_BASE=${f:2:1} \
      BITDELTA_AB_TERMS_QX=${f:3:1}
    echo "round $round store ${f:0:1} prio ${f:1:1} stream base ${f:2:1} qx ${f:3:1}: $(timeout 60 .device/bin/bench_gpu_e2e /tmp/l7b \
      --decode 16 --profile-case mixed 2>&1 | grep -E '^batch' | tr '\n' ' ')"
  done
done
unset BITDELTA_AB_TERMS_STORE BITDELTA_AB_ROUTE_PRIO BITDELTA_AB_STREAM_BASE BITDELTA_AB_TERMS_QX
for round in 1 2; do
  for s in 0 1; do
    left 560 "batch 1 round $round $s" && continue
    export BITDELTA_AB_STAGE_ALL=$s
    echo "round $round, stage everywhere $s: $(.device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case "batch 1" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
  done
done
unset BITDELTA_AB_STAGE_ALL
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then  # (a) at 4096², the committed form
  for round in 1 2 3; do
    left 580 "(a) round $round" && continue
    echo "-- (a) round $round"
    .device/bin/bench_cuda_fused_linear --one-row 4096 4096 > /tmp/a.log 2>&1
    grep -E "copy of|balanced, chain of 20 |after a norm|graph of 20" /tmp/a.log
  done
fi
stamp done
} > $L 2>&1
cat $L
