# Entry points: `make example` and `make test` (what CI runs, through .ci/run).
#
# Both Pythons are first-class, each in its own venv:
#   3.11 -> .venv     a CPU build of torch, megatron-core 0.16.1 (the newest release for 3.11), triton 3.6.0
#   3.12 -> .venv312  the index's torch (a CUDA build on Linux, run on CPU without a GPU),
#                     megatron-core 0.19.2, the triton that torch requires
# `make test` runs the whole suite on each and the Triton kernel tests under the newest triton;
# `make versions` runs scripts/megatron_versions.sh (every supported release on its Python).
# `make example` and `make install` use 3.11; `make example PY=3.12` the other.
# Torch and megatron-core are installed only where none is importable, and npuspeed's own
# install (megatron-core>=0.12,<0.20) keeps whatever supported release is there.
PY ?= 3.11
NPROC ?= 2
VENV311 ?= .venv
VENV312 ?= .venv312
# The interpreters the venvs are made from; scripts/find_python.sh finds them when left empty.
BASE_PYTHON311 ?=
BASE_PYTHON312 ?=
TORCH311 ?= torch==2.13.0+cpu
TORCH312 ?= torch==2.14.1
MCORE311 ?= 0.16.1
MCORE312 ?= 0.19.2
TRITON311 ?= 3.6.0
TRITON_NEWEST ?= 3.9.0
CPU_INDEX ?= https://download.pytorch.org/whl/cpu

PY311 := $(VENV311)/bin/python
PY312 := $(VENV312)/bin/python
ifeq ($(PY),3.12)
VENV ?= $(VENV312)
else ifeq ($(PY),3.11)
VENV ?= $(VENV311)
else
$(error PY=$(PY): the supported Pythons are 3.11 and 3.12)
endif
VPY := $(VENV)/bin/python
TRITON_SITE := .triton-$(TRITON_NEWEST)
TRITON_TESTS := tests/unit/test_triton_kernels.py tests/unit/test_reuse_fp32_triton.py \
                tests/unit/test_moe_permute_triton_choice.py tests/unit/test_rope_qk_triton_wiring.py

.PHONY: deps311 deps312 install install-test install-test-311 install-test-312 example \
        test test-311 test-312 test-full test-triton versions test-device test-device-host device-report readme-device bench clean

# A venv per Python, from the interpreter found (or named), with current packaging tools.
$(PY311):
	base="$(BASE_PYTHON311)"; [ -n "$$base" ] || base=$$(scripts/find_python.sh 3.11) && "$$base" -m venv $(VENV311)
	$(PY311) -m pip install -q --upgrade pip setuptools wheel

$(PY312):
	base="$(BASE_PYTHON312)"; [ -n "$$base" ] || base=$$(scripts/find_python.sh 3.12) && "$$base" -m venv $(VENV312)
	$(PY312) -m pip install -q --upgrade pip setuptools wheel

# torch, megatron-core (and on 3.11 triton) where none is importable: an installed one is kept.
deps311: $(PY311)
	@$(PY311) -c "import torch" 2>/dev/null || $(PY311) -m pip install -q "$(TORCH311)" || \
	  $(PY311) -m pip install -q "$(TORCH311)" --extra-index-url $(CPU_INDEX)
	@$(PY311) -c "import megatron.core" 2>/dev/null || $(PY311) -m pip install -q "megatron-core==$(MCORE311)"
	@$(PY311) -c "import triton" 2>/dev/null || [ "$$(uname -sm)" != "Linux x86_64" ] || \
	  $(PY311) -m pip install -q "triton==$(TRITON311)"

deps312: $(PY312)
	@$(PY312) -c "import torch" 2>/dev/null || $(PY312) -m pip install -q "$(TORCH312)"
	@$(PY312) -c "import megatron.core" 2>/dev/null || $(PY312) -m pip install -q "megatron-core==$(MCORE312)"

# One pip install each (it compiles csrc/ every time it runs).
install: deps$(subst .,,$(PY))
	$(VPY) -m pip install -q --no-build-isolation -e .

install-test: deps$(subst .,,$(PY))
	$(VPY) -m pip install -q --no-build-isolation -e ".[test,bench]"

install-test-311: deps311
	$(PY311) -m pip install -q --no-build-isolation -e ".[test,bench]"

install-test-312: deps312
	$(PY312) -m pip install -q --no-build-isolation -e ".[test,bench]"

# The example: a small Llama-style model (RMSNorm, SwiGLU, RoPE, GQA, bf16) at TP2 + SP, trained
# twice in one command, without npuspeed's flags and with the ones a Llama user turns on
# (EXAMPLE_FLAGS), then that run's own report: features and paths chosen, counters, tokens/s and
# peak memory against the run without the flags.
EXAMPLE_MODEL ?= --tensor-model-parallel-size 2 --sequence-parallel --use-cpu-initialization \
  --num-layers 2 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8 \
  --group-query-attention --num-query-groups 2 --seq-length 512 --max-position-embeddings 512 \
  --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear \
  --untie-embeddings-and-output-weights --bf16 --micro-batch-size 1 --global-batch-size 4 \
  --train-iters 10 --lr 3e-4 --lr-warmup-iters 2 --log-interval 5
EXAMPLE_FLAGS ?= --use-flash-attn --use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb \
  --use-fused-linear-cross-entropy

example: install
	mkdir -p runs
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) examples/pretrain_gpt.py $(EXAMPLE_MODEL) \
	  --summary-json runs/example_baseline.json
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) examples/pretrain_gpt.py $(EXAMPLE_MODEL) $(EXAMPLE_FLAGS) \
	  --summary-json runs/example_summary.json
	$(VENV)/bin/npuspeed report --run runs/example_summary.json --baseline runs/example_baseline.json

# CI (.ci/run): the whole suite on Python 3.11 (megatron-core 0.16.1, a CPU build of torch) and
# on Python 3.12 (megatron-core 0.19.2, the index's CUDA build of torch on a host without a GPU),
# then the Triton kernel tests under the newest triton.
# The multi-process files (torchrun runs of the example) are split between the two Pythons
# (tests/shards.py: NPUSPEED_TEST_SHARD); `make test-full` runs every file on both.
test: test-311 test-312 test-triton

test-311: install-test-311
	NPUSPEED_TEST_SHARD=3.11 $(PY311) -m pytest -q tests

test-312: install-test-312
	NPUSPEED_TEST_SHARD=3.12 $(PY312) -m pytest -q tests

test-full: install-test-311 install-test-312
	NPUSPEED_TEST_SHARD= $(PY311) -m pytest -q tests
	NPUSPEED_TEST_SHARD= $(PY312) -m pytest -q tests

# The Triton test files again under triton $(TRITON_NEWEST), unpacked beside the checkout
# (pip --target, no dependencies) and put first on PYTHONPATH, which the tests' subprocesses inherit.
$(TRITON_SITE)/triton/__init__.py: | $(PY311)
	$(PY311) -m pip install -q --no-deps --target $(TRITON_SITE) "triton==$(TRITON_NEWEST)"

test-triton: install-test-311 $(TRITON_SITE)/triton/__init__.py
	PYTHONPATH=$(CURDIR)/$(TRITON_SITE) $(PY311) -c \
	  "import triton; assert triton.__version__ == '$(TRITON_NEWEST)', triton.__file__"
	PYTHONPATH=$(CURDIR)/$(TRITON_SITE) $(PY311) -m pytest -q $(TRITON_TESTS)

# Every supported megatron-core release, each on a Python it installs on (0.17+ need 3.12).
versions: install-test-311 install-test-312
	PYTHON=$(CURDIR)/$(PY311) PYTHON311=$(CURDIR)/$(PY311) PYTHON312=$(CURDIR)/$(PY312) scripts/megatron_versions.sh

# The device tier: every single-rank feature trained on the accelerator present (CUDA or NPU,
# as npuspeed detects it), by a Python whose torch sees it (scripts/device_python.sh: DEVICE_PY,
# the venv, or the system's; none is a one-line error); on a host without one each test is
# skipped with the reason (exit 0). Plain `pytest -m device` applies the same rule itself (tests/tiers.py:
# device_refusal): an accelerator named but unseen by its torch fails there in one line too. The checkout goes on PYTHONPATH (no install needed there).
# An offline GPU host: put wheels (megatron-core, ...) in $(WHEELS) and they are unpacked into
# $(DEVICE_SITE) (pip --no-index --no-deps --target), which goes on PYTHONPATH too.
DEVICE_PY ?=
WHEELS ?= .whl
DEVICE_SITE ?= .device-site
DEVICE_ENV = NPUSPEED_DEVICE= PYTHONPATH="$(CURDIR)$(if $(wildcard $(DEVICE_SITE)),:$(CURDIR)/$(DEVICE_SITE))$${PYTHONPATH:+:$$PYTHONPATH}"
# the Python (in $$py) and megatron-core importable by it, or one line naming the fix
DEVICE_SETUP = py=$$(DEVICE_PY="$(DEVICE_PY)" scripts/device_python.sh "$(CURDIR)/$(VPY)") || exit 2; \
	if [ "$$py" = "$(CURDIR)/$(VPY)" ] && ! "$$py" -c "import torch, megatron.core, pytest" 2>/dev/null; then \
	  $(MAKE) --no-print-directory install-test || exit 1; fi; \
	if ls $(WHEELS)/*.whl >/dev/null 2>&1 && [ ! -d $(DEVICE_SITE) ]; then \
	  "$$py" -m pip install -q --no-index --no-deps --target $(DEVICE_SITE) $(WHEELS)/*.whl || exit 1; fi; \
	$(DEVICE_ENV) "$$py" -c "import megatron.core" 2>/dev/null || { echo "$@: megatron-core is not importable by $$py: \
	put its wheel in $(WHEELS)/ (pip download --no-deps megatron-core==$(MCORE312) -d $(WHEELS)) or install it there" >&2; exit 2; }

test-device:
	@$(DEVICE_SETUP); echo "device tier: $$py"; \
	$(DEVICE_ENV) "$$py" -m pytest -q -m device tests/device

# The device tier's own code on this CPU with a tiny model (the tests' keys, counters and runs
# checked before a device is lent; device-only checks skipped with the reason): 12-16 minutes
# on a 2-core host, so not part of `make test`.
test-device-host: install-test
	NPUSPEED_DEVICE_TIER_HOST=cpu $(VPY) -m pytest -q -m device tests/device

# The accelerator figures (runs/device-report/: report.json, report.md, PNGs): the tier, the
# example's end-to-end and per-flag runs at 709M parameters (two of them profiled), the compute
# floor, the torchtitan check, the fused-op tables. One lease holds it in two calls of the same
# commit (docs/accelerators.md, "Fitting one lease"):
# REPORT_ARGS="--parts training codec floor torchtitan --budget-s 560", then
# REPORT_ARGS="--parts fused_ops triton_ops tier --budget-s 330"; the second keeps the first's
# sections. `make readme-device` then puts report.md into docs/accelerators.md.
device-report:
	@$(DEVICE_SETUP); echo "device report: $$py"; \
	$(DEVICE_ENV) "$$py" benchmarks/device_report/run.py --out runs/device-report $(REPORT_ARGS)

readme-device:
	python3 benchmarks/device_report/readme.py runs/device-report docs/accelerators.md

bench: install-test
	$(VPY) -m pytest -q -m slow tests
	for b in benchmarks/bench_*.py; do $(VPY) $$b || exit 1; done

clean:
	rm -rf build *.egg-info npuspeed/_C*.so runs .triton-* $(DEVICE_SITE)
