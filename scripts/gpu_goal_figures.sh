#!/bin/bash
# Issue #4's figures in one call, for the H200 its goals are set on (bench/RESULTS-gpu.md, stop 40's list):
# the kernels' (a), (b), (c) and their latency options (bench/engine_gpu.py), the engine's layers
# (bench/engine_layer_gpu.py), (e) at 16 layers, then (d) and (f) at 32, as long as the call's time lasts.
# On an H100 the same figures compare with earlier stops' H100 runs, not with the goals.
#
#   bash scripts/gpu_goal_figures.sh [LIMIT]     (carry: [".gpu", ".whl"]; LIMIT: the call's seconds, 570)
# Logs come back in $OUT (scripts/gpu_common.sh).
limit=${1:-570}
source scripts/gpu_common.sh
step kernels python3 bench/engine_gpu.py
step layers python3 bench/engine_layer_gpu.py --layers 4
step e16 "${e2e[@]}" --layers 16 --only e
step df32 "${e2e[@]}" --layers 32 --only df --cold-rounds 8 --pinned-mb 3072
save_triton_cache
