# Two commands: `make run` and `make test`. Each installs what it needs (idempotently) first.
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: run test install install-test lint unit integration bench proto adapters

install:
	@scripts/bootstrap.sh runtime

install-test:
	@scripts/bootstrap.sh test

run: install
	$(PY) -m gateway serve

lint: install-test
	.venv/bin/ruff check .
	.venv/bin/mypy

test: install-test lint
	$(PY) -m pytest -q

unit: install-test
	$(PY) -m pytest -q tests/unit

integration: install-test
	$(PY) -m pytest -q tests/integration

bench: install-test
	$(PY) bench/engine_cpu.py
	$(PY) bench/gateway_rest.py
	$(PY) bench/fairness.py
	$(PY) bench/fairness_live.py
	$(PY) bench/adapter_cache.py
	$(PY) bench/adapter_loading.py
	$(PY) bench/detokenize.py
	$(PY) bench/sampling.py
	$(PY) bench/chunked_prefill.py
	$(PY) bench/prefix_caching.py

proto: install-test
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. engine/engine.proto

adapters: install-test
	$(PY) scripts/train_demo_adapters.py
