#!/usr/bin/env bash
# Session 56: run 384's estimate for single-row slots at K = 8192 (it measured K = 4096 only): (b) at
# 8192² and 28672x8192, where the estimate takes 4 warps along K instead of 8, alternated twice with the
# rule before it (bundle from runs/run386_ab_terms_waves.diff on the committed estimate:
# BITDELTA_AB_TERMS_WAVES=0, pairs of slot rows alone take it).
#   run(command="bash bench/cuda/runs/run386.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
grep -qa BITDELTA_AB_TERMS_WAVES .device/bin/bench_cuda_fused_linear || { echo "run386.sh: the bundle lacks the switch"; exit 1; }
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64
L=$OUT/run386.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for round in 1 2; do
  for ab in 0 1; do
    stamp "(b) round $round, estimate for single-row slots $ab"
    BITDELTA_AB_TERMS_WAVES=$ab timeout 60 .device/bin/bench_cuda_fused_linear --many-variants 8192 8192 28672 8192 \
      > /tmp/b.log 2>&1; echo "rc $?"
    grep -E "route, folded, graph of 20 |alternated|terms alone, graph" /tmp/b.log
  done
done
stamp done
} > $L 2>&1
cat $L
