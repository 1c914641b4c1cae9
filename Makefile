# Two commands do all set-up:  `make demo` (the main job) and `make test` (the test suite).
# Both build .venv from the pinned lock on first use; nothing needs to be installed by hand.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.prefixshare-installed
LOCK   := requirements/lock-cpu.txt
export LMCACHE_TRACK_USAGE := false
export LMCACHE_DISABLE_BANNER := 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv test test-fast demo lock clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first so that nothing below can pull a CUDA build; the lock pins every other version.
	$(PY) -m pip install -q -c $(LOCK) "torch==2.13.0"
	$(PY) -m pip install -q -c $(LOCK) -e ".[test,vllm,model,demo]"
	# CUDA-only wheels that break or slow a CPU torch environment (see docs/environment.md).
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -ra --durations=15 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -ra -m "not engine" $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/prefixshare plan qwen3-8b --tokens 1024,4096,16384 --link 10GbE --link 100GbE --prefill-rate 8000
	$(VENV)/bin/prefixshare plan bench --tokens 1024,2048,4096,8192 --link 10GbE --prefill-rate 500

# Regenerate the lock from the current venv (run after changing dependencies, then commit it).
lock:
	$(PY) -m pip freeze --exclude-editable | grep -v -E "^(torchvision|torchaudio|torchcodec|triton)==" > $(LOCK)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
