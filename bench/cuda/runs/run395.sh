#!/usr/bin/env bash
# Session 57: run392.sh on an H200 (the table on the committed code); on any other card only
# the card's power limit and clocks (whether H100 machines cap the power that the fused prompt GEMMs
# would need for the clock cuBLAS's GEMMs reach: runs 390-394).
#   run(command="bash bench/cuda/runs/run395.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
nvidia-smi --query-gpu=name,power.limit,power.default_limit,power.max_limit,clocks.max.sm,clocks.sm --format=csv
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash bench/cuda/runs/run392.sh; fi
exit 3
