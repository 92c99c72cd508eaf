# dualkv: two commands do everything on a fresh Linux machine.
#   make demo   set up, build, run the GRPO demo on the best available backend
#   make test   set up, build, run every test (C++ incl. ASan/UBSan, Python; GPU tests when a GPU is present)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
JOBS ?= $(shell nproc)
# CUDA backends for `make build`: AUTO builds them when nvcc is found. CUDA_ARCHS / HEAD_DIMS, when
# set, select archs and head dims (CMakeLists.txt has the defaults, src/cuda/CMakeLists.txt the table).
CUDA ?= AUTO
CUDA_SELECT = $(if $(CUDA_ARCHS),"-DDUALKV_CUDA_ARCHS=$(CUDA_ARCHS)") $(if $(HEAD_DIMS),"-DDUALKV_HEAD_DIMS=$(HEAD_DIMS)")
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
HAVE_NVCC := $(shell command -v nvcc >/dev/null 2>&1 || test -x /usr/local/cuda/bin/nvcc && echo 1)
# Without a GPU the tests run on a CPU-only library; the CUDA sources get a compile check instead.
TEST_CUDA ?= $(if $(HAVE_GPU),$(CUDA),OFF)
export PATH := $(PATH):/usr/local/cuda/bin

.PHONY: all setup system-deps build build-local test test-cpp test-sanitize test-python fuzz cuda-check demo wheel clean

all: build

system-deps:
	@if [ ! -f /usr/include/gtest/gtest.h ] || [ ! -f /usr/include/eigen3/Eigen/Core ] || ! command -v cmake >/dev/null; then \
	  echo "installing GoogleTest, Eigen and CMake from Debian packages"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq libgtest-dev libeigen3-dev cmake g++ >/dev/null; \
	  else echo "error: need libgtest-dev, libeigen3-dev and cmake (run as root or install them)"; exit 1; fi; \
	fi

$(VENV)/.stamp: requirements-dev.txt requirements-rl.txt requirements-verl.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt -r requirements-rl.txt
	$(PY) -m pip install -q --no-deps -r requirements-verl.txt
	touch $@

setup: system-deps $(VENV)/.stamp

build: system-deps
	cmake -S . -B build -DDUALKV_CUDA=$(CUDA) $(CUDA_SELECT) >/dev/null
	cmake --build build -j$(JOBS)

build-local: system-deps
	cmake -S . -B build -DDUALKV_CUDA=$(TEST_CUDA) $(CUDA_SELECT) >/dev/null
	cmake --build build -j$(JOBS)

test-cpp: build-local
	cd build && ctest --output-on-failure -j$(JOBS)

# The C++ suite again under AddressSanitizer + UndefinedBehaviorSanitizer (host code).
test-sanitize: system-deps
	cmake -S . -B build-asan -DDUALKV_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug -DDUALKV_SANITIZE=address,undefined >/dev/null
	cmake --build build-asan -j$(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j$(JOBS)

# The long run of the seeded layout fuzzer (tests/cpp/fuzz_layouts.cpp; `make test` runs it for 30 s):
# FUZZ_LAYOUTS layouts from seed FUZZ_SEED, no time limit (10^6: ~50 s on 2 idle cores).
FUZZ_SEED ?= 20261201
FUZZ_LAYOUTS ?= 1000000
fuzz: build-local
	build/tests/cpp/dualkv_fuzz_layouts --seed $(FUZZ_SEED) --layouts $(FUZZ_LAYOUTS) --seconds 0

test-python: setup build-local
	PYTHONPATH=python DUALKV_LIBRARY=$(CURDIR)/build/libdualkv.so $(PY) -m pytest -q -rs tests/python $(if $(HAVE_GPU),tests/gpu,)

# Compiles a small subset of the CUDA kernels (head dim 64: the portable kernels for sm80 and sm90a,
# the Hopper forward and backward units, the dispatcher) so CI catches CUDA build breaks.
cuda-check:
	@if [ -n "$(HAVE_NVCC)" ]; then \
	  cmake -S . -B build-cuda-check -DDUALKV_CUDA=ON "-DDUALKV_CUDA_ARCHS=80;90a" -DDUALKV_HEAD_DIMS=64 -DDUALKV_BUILD_TESTS=OFF >/dev/null && \
	  cmake --build build-cuda-check -j$(JOBS); \
	else echo "cuda-check: nvcc not found, skipped"; fi

test: test-cpp test-sanitize test-python cuda-check
	@echo "make test: all suites passed"

demo: setup build-local
	PYTHONPATH=python DUALKV_LIBRARY=$(CURDIR)/build/libdualkv.so $(PY) -m dualkv demo $(DEMO_ARGS)

wheel: setup
	$(PY) -m pip wheel --no-build-isolation --no-deps -w dist .

clean:
	rm -rf build build-asan build-cuda-check dist
