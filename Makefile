# The two commands of the README: `make demo` and `make test`. Both run `make setup` first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.shardlm-installed
PYTHON ?= python3

.PHONY: setup test test-fast demo bench bench-scale lint clean matrix published-weights moe-grid

setup: $(STAMP)

# Idempotent: re-runs only when pyproject.toml changes. Without a GPU, torch==2.13.0 (a CPU
# build) is installed first so pip never pulls a multi-GB CUDA wheel on a CPU machine.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q 'torch>=2.13'; \
	else \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest

# The process-free tier alone (under a minute): plans, data, loss, estimates, the package's shape; not the
# sweeps that plan a dozen model types each (marked `sweep`, run by `make test`)
test-fast: setup
	$(PY) -m pytest -m "not ranks and not sweep"

demo: setup
	$(PY) examples/demo.py

# side by side with transformers in the same ranks, then each side in ranks of its own against the
# previous commit (benchmarks/against.py: a process-wide regression shows only there); pp=2 against fsdp=2
# and tp=2 and its schedule's bubble (benchmarks/pipeline.py; --all: every schedule)
bench: setup
	$(PY) benchmarks/bench.py
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/against.py --layouts tp2,fsdp2

# Models one step up (125M-349M Llama): shardlm estimate against measured peaks, save/load MB/s
bench-scale: setup
	$(PY) benchmarks/scale.py

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks examples scripts

clean:
	rm -rf runs .pytest_cache

# Compatibility matrix of every causal-LM type of the installed transformers (docs/compatibility.md)
matrix: setup
	$(PY) scripts/matrix.py --sizes equal,unequal

# Published checkpoint layouts of every causal-LM type with conversion rules (docs/published_weights.md),
# then the matrix's "published weights" column from it (the matrix itself is not rerun)
published-weights: setup
	$(PY) scripts/published_sweep.py
	$(PY) scripts/matrix.py --docs-only

# The MoE grid of issue 12: six families x tp2/ep2/fsdp2xep2/tp2xep2, resumes across layouts,
# consolidate + reload (docs/moe_grid.md)
moe-grid: setup
	$(PY) scripts/moe_grid.py
