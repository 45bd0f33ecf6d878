#!/bin/bash
# Issue #4's figures, for the H200 its goals are set on: the kernels' (a), (b), (c) (bench/engine_gpu.py,
# capped at 240 s so the rest gets its turn), the engine's layers (bench/engine_layer_gpu.py), (e) at 16
# layers, then (d) and (f) at 32, as long as the call's time lasts. On an H100 the same figures compare with
# earlier stops' H100 runs, not with the goals. The pacer's figures and the GPU tests are
# scripts/gpu_pacer_check.sh's.
#
#   bash scripts/gpu_goal_figures.sh [LIMIT]     (carry: [".gpu", ".whl"]; LIMIT: the call's seconds, 570)
# Logs come back in $OUT (scripts/gpu_common.sh).
limit=${1:-570}
source scripts/gpu_common.sh
step kernels timeout -k 10 240 python3 bench/engine_gpu.py --only abc
step layers python3 bench/engine_layer_gpu.py --layers 4
step e16 "${e2e[@]}" --layers 16 --only e
step df32 "${e2e[@]}" --layers 32 --only df --cold-rounds 8 --pinned-mb 3072
save_triton_cache
