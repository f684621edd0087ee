#!/usr/bin/env bash
# Session 51, for the next session: the stage's rule in the model. Forms (one bundle, built with
# runs/run368_stage_rule.diff applied; BITDELTA_AB_NO_STAGE): S (0, committed: the stage everywhere),
# A (1: the second batch to L2 everywhere, edc48f5's form) and H (2: to L2 only where a warp has one
# round of units, i.e. 4096² of the five shapes, where every bench form finds A faster and where on
# the H200 A alone meets 3.4 TB/s, run 366). Alternated three rounds: the 7B batch-1 step (where S
# was faster than A in 10 of 11 rounds, runs 359/362/365/367), and the one-row bench at 4096²,
# 11008×4096 and 4096×11008 (chains, step form, graphs). Then the GPU tests and kernel checks with H.
#   run(command="bash bench/cuda/runs/run368.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
grep -qa BITDELTA_AB_NO_STAGE .device/bin/bench_gpu_e2e || { echo "run368.sh: the bundle lacks the switch"; exit 1; }
L=$OUT/run368.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 2 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2 3; do
  for form in 0 1 2; do
    export BITDELTA_AB_NO_STAGE=$form
    stamp "round $round, form $form"
    .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case "batch 1" 2>&1 | grep -E '^batch'
    .device/bin/bench_cuda_fused_linear --one-row 4096 4096 11008 4096 4096 11008 > /tmp/a.log 2>&1
    grep -E "copy of|balanced, chain of 20 |after a norm|graph of 20" /tmp/a.log
  done
done
export BITDELTA_AB_NO_STAGE=2
stamp "tests with H"
.device/bin/bitdelta_gpu_tests > /tmp/gt.log 2>&1; echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" /tmp/gt.log | head
.device/bin/test_cuda_fused_linear > /tmp/kt.log 2>&1; echo "rc $?"
grep -E "^FAIL" /tmp/kt.log | head; tail -1 /tmp/kt.log
stamp done
} > $L 2>&1
cat $L
