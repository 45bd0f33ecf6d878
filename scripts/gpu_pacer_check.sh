#!/bin/bash
# The next GPU session's first call (bench/RESULTS-gpu.md, "Next GPU session"): hot swap (f) at 32 layers with
# the pacer on, by kind (stop 45's opt-in) and off (stop 45: 22 ms on, 0.78x off); (p) at 32 layers with the
# same three; (s) at 16 layers on and by kind; then the engine's GPU tests and (d) with (s) at 16 layers, as
# long as the call's time lasts.
#
#   bash scripts/gpu_pacer_check.sh [LIMIT]      (carry: [".gpu", ".whl"]; LIMIT: the call's seconds, 570)
# SWAPS sets (f)'s swaps of each mode (6). Logs come back in $OUT (scripts/gpu_common.sh).
limit=${1:-570}
source scripts/gpu_common.sh
step f32 "${e2e[@]}" --layers 32 --only f --swaps "${SWAPS:-6}" --compose-late on,by-kind,off
step p32 "${e2e[@]}" --layers 32 --only p --compose-late on,by-kind,off
step s16 "${e2e[@]}" --layers 16 --only s --compose-late on,by-kind
step gpu-tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py
step ds16 "${e2e[@]}" --layers 16 --only ds
save_triton_cache
