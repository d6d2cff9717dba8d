# `make demo` and `make test` set up everything on a fresh machine: .venv, torch (the CPU build
# when no torch is importable, never a multi-GB CUDA build), zenflow with its C++ core.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.zenflow-installed
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=
# DeepSpeed's JIT-built ops (the benchmarks' peers) per virtual environment: venvs sharing one
# build folder rebuild each other's ops, and a build killed midway leaves a lock that hangs
# every later one.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: demo test soak lint bench install clean

install: $(STAMP)

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,demo,hf]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/finetune_gpt.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q -m "not cuda" $(PYTEST_ARGS)

# Only the long-running tests (soak, crash loops); `make test` runs them too.
soak: $(STAMP)
	$(PY) -m pytest -q -m "slow and not cuda" $(PYTEST_ARGS)

bench: $(STAMP)
	@for script in benchmarks/bench_*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

clean:
	rm -rf build *.egg-info zenflow/*.so
