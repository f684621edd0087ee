#!/usr/bin/env bash
# Session 58: on an H200, run392.sh (the issue's table for the committed code) and then run397.sh
# (ncu's stall reasons of one fused prompt GEMM against cuBLAS's); on any other card only run397.sh.
#   run(command="bash bench/cuda/runs/run398.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "run398.sh on: $card"
if grep -q H200 <<< "$card"; then
  bash bench/cuda/runs/run392.sh
fi
bash bench/cuda/runs/run397.sh > /dev/null 2>&1
tail -c 9000 $OUT/run397.log
