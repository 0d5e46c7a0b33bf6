# The two commands of the README: `make demo` and `make test`. Both set up
# everything on a fresh machine: a venv cached OUTSIDE the clone, keyed by a
# hash of the pinned requirements (so CI reuses it and disk use stays flat),
# then the C++/CUDA extension, built in place with ninja (incremental).

PYTHON3  ?= python3
CACHE    ?= $(HOME)/.cache/d9d_kernels
HASH     := $(shell cat requirements-dev.txt constraints.txt | sha256sum | cut -c1-16)
VENV     := $(CACHE)/venv-$(HASH)
PY       := $(VENV)/bin/python
STAMP    := $(VENV)/.complete
# Archs for the CUDA kernels (no GPU here: torch's default would probe one and crash).
export TORCH_CUDA_ARCH_LIST ?= 8.0;9.0+PTX
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
SOURCES  := setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/host/*.cpp csrc/kernels/*.h csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.cuh)
EXT      := build/.ext-$(HASH)
EXT_CPU  := build/.ext-cpu-$(HASH)
HAS_GPU  := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
PYTEST_ARGS ?=

.PHONY: all venv build test demo bench clean distclean

all: build

# No file prerequisites: the path already holds the hash of their contents,
# and a fresh clone's newer mtimes must not rebuild a cached venv (~2.5 min).
$(STAMP):
	@echo ">> creating venv $(VENV)"
	@mkdir -p $(CACHE)
	@# other hashes are stale venvs: drop them so disk use stays flat
	@find $(CACHE) -maxdepth 1 -name 'venv-*' ! -name 'venv-$(HASH)' -exec rm -rf {} +
	@rm -rf $(VENV)
	$(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt -c constraints.txt
	@touch $(STAMP)

venv: $(STAMP)

$(EXT): $(STAMP) $(SOURCES)
	@echo ">> building d9d_kernels._C (TORCH_CUDA_ARCH_LIST=$(TORCH_CUDA_ARCH_LIST))"
	MAX_JOBS=2 $(PY) setup.py -q build_ext --inplace
	@rm -f $(EXT_CPU)
	@touch $(EXT)

# The demo on a machine without a GPU runs no CUDA kernel: it builds the C++
# CPU kernels only (minutes less on a fresh machine); `make test` still builds
# and checks the CUDA ones. Both write the same in-place module, so each
# target's stamp is removed when the other builds.
$(EXT_CPU): $(STAMP) $(SOURCES)
	@echo ">> building d9d_kernels._C, CPU kernels only (no GPU here)"
	D9D_KERNELS_BUILD_CUDA=0 MAX_JOBS=2 $(PY) setup.py -q build_ext --inplace
	@rm -f $(EXT)
	@touch $(EXT_CPU)

build: $(EXT)

test: build
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests

demo: $(if $(HAS_GPU),$(EXT),$(EXT_CPU))
	$(PY) examples/demo.py

bench: build
	$(PY) bench/run_all.py --quick

clean:
	rm -rf build d9d_kernels/_C*.so *.egg-info

distclean: clean
	rm -rf $(VENV)
