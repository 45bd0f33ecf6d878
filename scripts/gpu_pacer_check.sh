#!/bin/bash
# The next GPU session's first call (bench/RESULTS-gpu.md, "Next GPU session"): hot swap (f) at 32 layers with
# the pacer on and off, which stop 43's fix for eager steps should bring back to stop 40's 22 ms (0.78x); then
# the engine's GPU tests, (p) at 32 layers, and (d) with (s) at 16 layers, as long as the call's time lasts.
#
#   bash scripts/gpu_pacer_check.sh [LIMIT]      (carry: [".gpu", ".whl"]; LIMIT: the call's seconds, 570)
# SWAPS sets (f)'s swaps of each mode (6). Logs come back in $OUT (scripts/gpu_common.sh).
limit=${1:-570}
source scripts/gpu_common.sh
step f32 "${e2e[@]}" --layers 32 --only f --swaps "${SWAPS:-6}" --compose-late on,off
step gpu-tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py
step p32 "${e2e[@]}" --layers 32 --only p
step ds16 "${e2e[@]}" --layers 16 --only ds
save_triton_cache
