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

.PHONY: venv test test-fast demo bench bench-soak bench-quick lock clean services gpu-wheels gpu-check router

venv: $(STAMP)

$(STAMP): pyproject.toml $(LOCK) requirements/sglang-cpu.txt tests/env/_torchvision_cpu_fix.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first so that nothing below can pull a CUDA build; the lock pins every other version.
	$(PY) -m pip install -q -c $(LOCK) "torch==2.13.0"
	$(PY) -m pip install -q -c $(LOCK) -e ".[test,cpu,model,demo,valkey,mooncake]"
	# CUDA-only wheels that break a CPU torch environment and that nothing here imports.
	$(PY) -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
	# SGLang's CPU engine in the same environment: its wheel pins a CUDA torch, so it and the few runtime
	# dependencies it imports are installed without dependency resolution (requirements/sglang-cpu.txt).
	$(PY) -m pip install -q --no-deps -r requirements/sglang-cpu.txt
	# Test-environment hook that makes the registry's torchvision importable beside CPU torch (SGLang imports it).
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  cp tests/env/_torchvision_cpu_fix.py "$$site"/ && echo "import _torchvision_cpu_fix" > "$$site"/_torchvision_cpu_fix.pth
	touch $(STAMP)

test: $(STAMP) services
	$(PY) -m pytest -ra --durations=30 $(PYTEST_ARGS)

# Servers the tier tests start on loopback (a real Redis for the resp/valkey tiers), and the RDMA verbs
# library Mooncake's client links even over TCP (mooncake_store tier), nftables for the network lab's
# packet loss and cut links, and sshfs plus an SSH server for its shared filesystem over the network
# (tests/lab). On CI a missing one is an error; elsewhere those tests skip with the reason.
services:
	@missing=""; \
	  command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	  /sbin/ldconfig -p | grep -q libibverbs.so.1 || missing="$$missing libibverbs1"; \
	  command -v nft >/dev/null || missing="$$missing nftables"; \
	  { command -v sshfs && { command -v sshd || test -x /usr/sbin/sshd; }; } >/dev/null || \
	    missing="$$missing sshfs openssh-server"; \
	  test -z "$$missing" || { echo "installing:$$missing"; \
	    { apt-get update -q >/dev/null && apt-get install -y -q $$missing >/dev/null; } || \
	    { echo "could not install:$$missing (Redis for the resp/valkey tiers, libibverbs1 for the mooncake tier," \
	           "nftables, sshfs and openssh-server for the network lab)"; test -z "$$CI"; }; }

# The GPU check (tests/gpu/, LMCache's CUDA copy on synthetic KV; no engine): make gpu-wheels here, bring the
# tree with build/gpu-wheels/ to a GPU host, run make gpu-check there (CPU-only machines: the CUDA rows skip).
gpu-wheels: $(STAMP)
	PYTHON=$(PY) scripts/gpu-wheels

gpu-check:
	scripts/gpu-check

test-fast: $(STAMP)
	$(PY) -m pytest -ra -m "not engine" $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/prefixshare demo

# The full benchmark (about 10 minutes on 2 CPU cores); writes docs/benchmarks.md and docs/benchmarks/.
# Then the fleet under load against the same replicas without prefixshare (about 10 minutes;
# docs/benchmarks/load.json, shown in docs/reliability.md by tests/faults/render.py --write), and the mission's
# shared-document workload with the arms a user compares (about 35 minutes; docs/benchmarks/load-mission.md), and
# vLLM's own load client beside ours behind a real router (about 20 minutes; docs/benchmarks/load-standard.md).
bench: $(STAMP) services router
	$(VENV)/bin/prefixshare bench $(BENCH_ARGS)
	$(PY) tests/load/fleet.py --full
	$(PY) tests/load/mission.py --rates 1,2.5 --zero-rate 0.5,1 --duration 40 --reps 3
	$(PY) tests/load/mission.py --render
	$(PY) tests/load/standard.py --router $(ROUTER)
	$(PY) tests/lab/engines.py --full
	$(PY) tests/lab/links.py --full
	$(PY) tests/lab/sshfs_faults.py

# vLLM's router (a Rust binary with a Python wrapper) in an environment of its own: its dependencies are not the
# engines', and nothing in prefixshare imports it.
ROUTER := .venv-router/bin/vllm-router
router: $(ROUTER)

$(ROUTER):
	$(PYTHON) -m venv .venv-router
	.venv-router/bin/pip install -q "vllm-router==0.1.17"

# The soak: the fleet's workload at a steady rate for 30 minutes, every process's memory and file descriptors,
# /dev/shm and the store sampled each minute (docs/benchmarks/soak.json and soak.png).
bench-soak: $(STAMP) services
	$(PY) tests/load/fleet.py --soak 1800

bench-quick: $(STAMP)
	$(VENV)/bin/prefixshare bench --quick $(BENCH_ARGS)

# Regenerate the lock from the current venv (run after changing dependencies, then commit it).
lock:
	$(PY) -m pip freeze --exclude-editable | grep -v -E "^(torchaudio|torchcodec)==" > $(LOCK)

clean:
	rm -rf $(VENV) .venv-router .pytest_cache .hypothesis
