# Two commands on a fresh machine:  make train  (then)  make test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA := data/synthetic_laion
# make test runs the suite on this many pytest-xdist workers, whole files each (docs/performance/test_suite.md)
TEST_WORKERS ?= 2

.PHONY: train test test-slow lint data bench gpu-check clean-outputs help slurm

help:
	@echo "make train      create .venv, install, generate the embedded data, train mllm_tiny on CPU"
	@echo "make test       import-linter, then the default suite on TEST_WORKERS=2 workers (docs/performance/test_suite.md)"
	@echo "make test-slow  the long tests (marked slow)"
	@echo "make lint       ruff and import-linter (.importlinter: the layers of docs/ARCHITECTURE.md)"
	@echo "make slurm      install Debian's slurm-wlm and munge for tests/slurm (root, apt; make test does it)"
	@echo "make bench      tools/bench_*.py -> docs/results/*.json (summarized in docs/PERFORMANCE.md)"
	@echo "make gpu-check  tools/gpu_check.py: every CUDA path one GPU reaches (docs/GPU.md)"

# pip byte-compiles every package it installs (about half of the install's 48 s here). Keep it: with
# PYTHONDONTWRITEBYTECODE=1 (set on this machine and in CI) an import never writes a .pyc, so without them
# every fresh interpreter compiles torch from source: 8.7 s instead of 3.5 s to import train.py's modules,
# and a clean-clone make test took 18 min 42 s instead of about 15.
$(STAMP): requirements.txt pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e . || \
		$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# The optional trackers (W&B, MLflow: the .[trackers] extra) for the suite, which reads each one back
TRACKERS := $(VENV)/.trackers
$(TRACKERS): $(STAMP) requirements-trackers.txt
	$(BIN)/python -m pip install --quiet -r requirements-trackers.txt
	touch $(TRACKERS)

# A real SLURM for tests/slurm (tools/local_slurm.py starts it): Debian's slurm-wlm and munge, installed once where
# this runs as root with apt, the install's seconds printed; elsewhere tests/slurm skip and say why.
SLURM_PKGS := slurmctld slurmd slurm-client munge
SLURM_STAMP := $(VENV)/.slurm
$(SLURM_STAMP): | $(STAMP)
	@if command -v slurmctld >/dev/null && command -v munged >/dev/null; then echo "slurm: already installed"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then start=$$(date +%s); \
		export DEBIAN_FRONTEND=noninteractive; \
		{ apt-get install -y -q --no-install-recommends $(SLURM_PKGS) >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $(SLURM_PKGS) >/dev/null; }; } && \
		echo "slurm: installed $(SLURM_PKGS) in $$(( $$(date +%s) - start )) s" || \
		echo "slurm: apt-get could not install $(SLURM_PKGS): tests/slurm will skip"; \
	else echo "slurm: not installed (needs root and apt-get): tests/slurm will skip"; fi
	touch $@

slurm: $(SLURM_STAMP)

$(DATA): | $(STAMP)
	$(BIN)/python tools/make_shards.py

data: $(DATA)

train: $(STAMP) $(DATA)
	$(BIN)/python train.py

# pytest exits 5 when nothing was collected: an empty default suite is a failure,
# an empty slow selection is not.
test: $(STAMP) $(TRACKERS) $(SLURM_STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile -q --durations=20 \
		--junitxml=outputs/tests/junit.xml

test-slow: $(STAMP) $(TRACKERS) $(SLURM_STAMP)
	$(BIN)/python -m pytest -m slow -q; status=$$?; [ $$status -eq 5 ] && exit 0; exit $$status

lint: $(STAMP)
	$(BIN)/ruff check disttrain_core tools tests train.py
	$(BIN)/ruff format --check disttrain_core tools tests train.py
	$(BIN)/lint-imports --no-cache

bench: $(STAMP) $(DATA)
	$(BIN)/python tools/bench_train.py
	$(BIN)/python tools/bench_pipeline.py
	$(BIN)/python tools/bench_pipeline.py model=llama_tiny out=docs/results/bench_pipeline_llama.json
	$(BIN)/python tools/bench_layouts.py
	$(BIN)/python tools/bench_data.py
	$(BIN)/python tools/bench_kernels.py
	$(BIN)/python tools/bench_layouts.py processes=4 out=docs/results/bench_layouts_4.json
	$(BIN)/python tools/bench_layouts.py workload=audio
	$(BIN)/python tools/bench_layouts.py workload=video
	$(BIN)/python tools/bench_train.py litgpt=only steps=10 warmup=5 litgpt_repeats=6
	$(BIN)/python tools/bench_planner.py

gpu-check: $(STAMP)
	$(BIN)/python tools/gpu_check.py

clean-outputs:
	rm -rf outputs
