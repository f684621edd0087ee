#!/usr/bin/env bash
# Session 57: run387.sh on an H200 only (the issue's figures are the H200's); on any other card it
# stops at once, so the call costs only the machine's start. The bundle adds the cold load's split
# (the file's paging-in and the pinned buffer's allocation beside it) to bench_gpu_e2e.
#   run(command="bash bench/cuda/runs/run388.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if ! grep -q H200 <<< "$card"; then echo "run388.sh: $card, not an H200: nothing run"; exit 3; fi
bash bench/cuda/runs/run387.sh
