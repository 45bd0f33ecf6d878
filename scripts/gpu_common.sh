# Sourced by the GPU-call scripts (scripts/gpu_*.sh) on the device machine, from the repository root, with
# `limit` (the call's seconds) set: installs the carried wheels (.whl), seeds triton's kernel cache from
# .gpu/triton-cache.tar.xz, and defines `step NAME COMMAND...` (runs a command into $OUT/NAME.log within the
# time left) and `save_triton_cache` (brings the cache back as $OUT/triton-cache.tar.xz: cubins and metadata,
# no IR; copy it to .gpu/ and the next fresh machine starts with it). What the calls carry is made by
# scripts/prepare_gpu_carry.sh. Pass a limit below the device time left: the call is cut short there.
: "${OUT:?the device machine sets OUT, the folder whose files come back}"
start=$(date +%s)
# Kept back from each step's time: 10 s for a step that ignores its SIGTERM (the bench's clean-up of its
# scratch model runs at exit) and 25 s for the cache's save.
seconds_left() { echo $((limit - ($(date +%s) - start) - 35)); }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    exit 1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .gpu/triton-cache.tar.xz ] && tar -xJf .gpu/triton-cache.tar.xz -C "$TRITON_CACHE_DIR"; then
    echo "triton cache seeded: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files"
else
    echo "triton cache: none seeded"
fi
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
    timeout -k 10 "$left" "$@" >"$OUT/$name.log" 2>&1
    echo "exit $? for $name, $(($(date +%s) - start)) s into the call"
    tail -40 "$OUT/$name.log"
    # A step killed before its clean-up leaves its scratch model (13 GB at 32 layers) for the next to add to.
    rm -rf /tmp/e2e-*
}

save_triton_cache() {
    # Written aside and renamed once whole: a save cut short must not come back as a truncated archive.
    if (cd "$TRITON_CACHE_DIR" && find . -type f ! -name '*.ttir' ! -name '*.ttgir' ! -name '*.llir' \
        ! -name '*.ptx' ! -name '*.source' -print0 |
        XZ_OPT='-T0 -1' timeout 20 tar --null -cJf "$OUT/triton-cache.partial" -T -); then
        mv "$OUT/triton-cache.partial" "$OUT/triton-cache.tar.xz" && ls -la "$OUT/triton-cache.tar.xz"
    else
        rm -f "$OUT/triton-cache.partial"
        echo "triton cache not saved"
    fi
    echo "call took $(($(date +%s) - start)) s"
}
