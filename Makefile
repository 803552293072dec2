# Two entry points a newcomer needs: `make example` and `make test`.
# Both create .venv (unless VENV points elsewhere), install a CPU build of torch when none is
# importable (never a multi-GB CUDA build just to run on CPU), then npuspeed with its C++ ops.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
CPU_INDEX ?= https://download.pytorch.org/whl/cpu
NPROC ?= 2

.PHONY: torch install install-test example test test-device bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel

torch: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || \
	  $(PY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" || \
	  $(PY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" --extra-index-url $(CPU_INDEX)

# One pip install each (it compiles csrc/ every time it runs).
install: torch
	$(PY) -m pip install -q --no-build-isolation -e .

install-test: torch
	$(PY) -m pip install -q --no-build-isolation -e ".[test,bench]"

example: install
	mkdir -p runs
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) examples/pretrain_gpt.py \
	  --tensor-model-parallel-size 2 --sequence-parallel --use-cpu-initialization \
	  --train-iters 30 --lr 3e-3 --summary-json runs/example_summary.json
	$(VENV)/bin/npuspeed report

test: install-test
	$(PY) -m pytest -q tests

# The device tier: every single-rank feature trained on the accelerator present (CUDA or NPU,
# as npuspeed detects it); on a host without one each test is skipped with the reason (exit 0).
test-device: install-test
	NPUSPEED_DEVICE= $(PY) -m pytest -q -m device tests/device

bench: install-test
	$(PY) -m pytest -q -m slow tests
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf build *.egg-info npuspeed/_C*.so runs
