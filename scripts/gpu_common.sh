# Sourced by the GPU-call scripts (scripts/gpu_*.sh) on the device machine, from the repository root, with
# `limit` (the call's seconds) set: installs the carried wheels (.whl), seeds triton's kernel cache from
# .gpu/triton-cache.tar.xz, and defines `step NAME COMMAND...` (runs a command into $OUT/NAME.log within the
# time left) and `save_triton_cache` (brings the cache back as $OUT/triton-cache.tar.xz: cubins and metadata,
# no IR; copy it to .gpu/ and the next fresh machine starts with it). What the calls carry is made by
# scripts/prepare_gpu_carry.sh.
start=$(date +%s)
seconds_left() { echo $((limit - ($(date +%s) - start) - 25)); } # 25 s kept for the cache's save

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    exit 1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .gpu/triton-cache.tar.xz ] && tar -xJf .gpu/triton-cache.tar.xz -C "$TRITON_CACHE_DIR"
rm -rf /tmp/e2e-* /dev/shm/*
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
git log --oneline -1 | tee "$OUT/head.txt"

# The whole engine at the goals' dimensions (Llama-7B, decode batch 64), with the default (device) loader.
e2e=(python3 bench/engine_gpu_e2e.py --tokenizer .gpu/tokenizer --shape llama-7b --running 64 --loaders device)

step() {
    local name=$1 left
    shift
    left=$(seconds_left)
    if [ "$left" -lt 30 ]; then
        echo "== $name skipped: $left s left"
        return
    fi
    echo "== $name (up to $left s) at $(date +%T)"
    timeout "$left" "$@" >"$OUT/$name.log" 2>&1
    echo "exit $? for $name, $(($(date +%s) - start)) s into the call"
    tail -40 "$OUT/$name.log"
}

save_triton_cache() {
    (cd "$TRITON_CACHE_DIR" && find . -type f ! -name '*.ttir' ! -name '*.ttgir' ! -name '*.llir' ! -name '*.ptx' \
        ! -name '*.source' -print0 | tar --null -cJf "$OUT/triton-cache.tar.xz" -T -)
    echo "call took $(($(date +%s) - start)) s"
}
