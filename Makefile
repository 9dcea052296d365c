# Fresh machine to a trained model (`make run`) or a passing suite (`make test`).
PYTHON ?= python3
VENV   := .venv
PIP    := $(VENV)/bin/pip
RUN_NAME ?= local-$(shell date +%Y%m%d-%H%M%S)

.PHONY: run test lint system-packages clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	touch $@

# Two local CPU ranks through torchrun (gloo) on the bundled sample.
run: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 -m ddp_slurm.train --config jobs/mnist_sample.yaml run.name=$(RUN_NAME)
	@echo "run directory: runs/$(RUN_NAME)  (plots: $(VENV)/bin/python -m ddp_slurm.report runs/$(RUN_NAME))"

# As root, the real-cluster tests need Slurm, munge and iproute2 (Debian/Ubuntu packages).
system-packages:
	@if [ "$$(id -u)" = 0 ] && ! command -v slurmctld >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge iproute2; \
	fi

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(VENV)/.installed system-packages lint
	$(VENV)/bin/python -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache
