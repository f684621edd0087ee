#!/usr/bin/env bash
# Session 51, the last device time (about 250 s): on an H200 only (any other card: it says which and
# stops), 4096² alone, where (a) and (b) are open: the one-row bench (chains, step form, graphs) and the
# many-variants bench, with the stage (S, committed) and without (A, BITDELTA_AB_NO_STAGE; bundle built
# with runs/run362_ab_no_stage.diff applied), alternated twice.
#   run(command="bash bench/cuda/runs/run366.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
[[ $gpu == *H200* ]] || { echo "run366.sh: $gpu, not an H200: nothing run"; exit 0; }
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run366.log
{
date -u; echo "$gpu"
for round in 1 2; do
  for form in S A; do
    if [ $form = A ]; then export BITDELTA_AB_NO_STAGE=1; else unset BITDELTA_AB_NO_STAGE; fi
    echo "-- round $round, form $form"
    .device/bin/bench_cuda_fused_linear --one-row 4096 4096 > /tmp/a.log 2>&1
    grep -E "copy of|GemmEx|balanced, chain of 20 |after a norm|graph of 20|after the wait  " /tmp/a.log
    [ $round = 1 ] || continue
    .device/bin/bench_cuda_fused_linear --many-variants 4096 4096 > /tmp/b.log 2>&1
    grep -E "b: roofline|route, folded, graph of 20 |after a norm|alone \(16 rows\)" /tmp/b.log
  done
done
} > $L 2>&1
cat $L
