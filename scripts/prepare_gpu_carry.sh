#!/bin/bash
# What a GPU run needs beside the working tree, made here (the GPU machine has no network):
#   .gpu/tokenizer  the SmolLM2 tokenizer the GPU tests and benchmarks pass as --tokenizer
#                   (bench/engine_gpu_e2e.py, bench/first_joins.py; tests/gpu/test_engine_gpu.py reads it)
#   .whl/           wheels of the packages the GPU image lacks (xgrammar and its needs), for Python 3.12
# Both folders stay out of git (.git/info/exclude); a run carries them (`carry: [".gpu", ".whl"]`), and the
# GPU-call scripts (scripts/gpu_pacer_check.sh, scripts/gpu_goal_figures.sh) install the wheels first
# (scripts/gpu_common.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
for folder in /.gpu/ /.whl/; do
    grep -qx "$folder" .git/info/exclude 2>/dev/null || echo "$folder" >> .git/info/exclude
done
mkdir -p .gpu
scripts/bootstrap.sh test >.gpu/bootstrap.log 2>&1 || { tail -20 .gpu/bootstrap.log; exit 1; }
tokenizer=$(PYTHONPATH=. .venv/bin/python -c "
from engine.loader import cache_dir, resolve_model
from engine.tokenizer import Tokenizer
source = resolve_model('smollm2')
Tokenizer(source)  # converts the GGUF vocabulary once and keeps it beside the weights cache
print(cache_dir(source) / 'tokenizer')")
rm -rf .gpu/tokenizer && cp -r "$tokenizer" .gpu/tokenizer
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
# One version of each, pinned: two versions of a package in .whl stop the whole install there.
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 \
    pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
echo "ready: .gpu/tokenizer and $(ls .whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1))"
