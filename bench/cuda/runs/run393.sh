#!/usr/bin/env bash
# Session 57: run392.sh on an H200 (the table, the committed code); on any other card only the
# GPU tests of the committed code (the pinned pack registered portable, its mapping MADV_DONTFORK).
#   run(command="bash bench/cuda/runs/run393.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then exec bash bench/cuda/runs/run392.sh; fi
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
nvidia-smi --query-gpu=name --format=csv,noheader
.device/bin/bitdelta_gpu_tests > /tmp/gt.log 2>&1; echo "gpu tests rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|engine:" /tmp/gt.log | head
