# Fresh machine to a trained model (`make run`) or a passing suite (`make test`).
PYTHON ?= python3
VENV   := .venv
PIP    := $(VENV)/bin/pip
RUN_NAME ?= local-$(shell date +%Y%m%d-%H%M%S)
# TORCH=cpu: torch's CPU-only build from download.pytorch.org instead of PyPI's CUDA build (whose
# nvidia-* wheels alone take 3.2 GB); for a machine without a GPU. That index is asked for torch and
# torchvision alone (and their dependencies, which it mirrors), after a probe that fails at once where it is
# blocked; the rest comes from PyPI, where torch is then already installed. Its +cpu version outranks PyPI's,
# so an existing .venv with PyPI's build switches (--upgrade).
TORCH ?=
CPU_INDEX := https://download.pytorch.org/whl/cpu
# torch and torchvision as setup.cfg requires them (the versions live there)
TORCH_REQS := $(shell sed -n 's/^[[:space:]]*\(torch\(vision\)\{0,1\}[<>=][^[:space:]]*\).*/"\1"/p' setup.cfg)
TORCH_CPU := $(if $(filter cpu,$(TORCH)),yes)

.PHONY: run test lint system-packages clean FORCE

# The build asked for (TORCH=...), remembered in .venv: asking for another one redoes the install below.
$(VENV)/.torch-choice: FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH)' | cmp -s - $@ || echo '$(TORCH)' > $@

# What training needs (torch, torchvision, submitit, ...), no test tools. The last line says which torch
# build pip installed, and warns when it is not the one asked for (pip falls back to PyPI's silently).
$(VENV)/.installed: setup.cfg pyproject.toml $(VENV)/.torch-choice
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(if $(TORCH_CPU),$(VENV)/bin/python -m ddp_slurm.tools.torchbuild --reach $(CPU_INDEX)/torch/)
	$(if $(TORCH_CPU),$(PIP) install -q --index-url $(CPU_INDEX) --upgrade $(TORCH_REQS))
	$(PIP) install -q -e .
	$(VENV)/bin/python -m ddp_slurm.tools.torchbuild $(TORCH)
	touch $@

# The test tools on top (pytest, ruff, tensorboard).
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@

# Two local CPU ranks (gloo) on the bundled sample, through the launcher that ends a stop with exit 75.
run: $(VENV)/.installed
	$(VENV)/bin/python -m ddp_slurm.launch --standalone --nproc_per_node 2 -m ddp_slurm.train --config jobs/mnist_sample.yaml run.name=$(RUN_NAME)
	@echo "run directory: runs/$(RUN_NAME)  (plots: $(VENV)/bin/python -m ddp_slurm.report runs/$(RUN_NAME))"

# As root, the real-cluster tests need Slurm, munge and iproute2 (Debian/Ubuntu packages).
system-packages:
	@if [ "$$(id -u)" = 0 ] && ! command -v slurmctld >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge iproute2; \
	fi

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The cluster tests (then a few others) and the rest run side by side (tests/run_suite.py); PYTEST_ARGS go to both.
test: $(VENV)/.installed-test system-packages lint
	$(VENV)/bin/python tests/run_suite.py $(PYTEST_ARGS)

# The environment only: runs/ (every checkpoint and metric trained here) and data/ are never touched.
clean:
	rm -rf $(VENV) .pytest_cache
