# The README's two set-up commands: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv on first use and installs what it needs; nothing has to be installed by hand.
PYTHON ?= python3
VENV ?= .venv
# Any torch >= 2.8 works. This pin is a CPU-friendly default; set TORCH="torch" (or your CUDA build) to change it.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The stamps name the torch requirement, so `make test TORCH=...` reinstalls when it changes.
MEDIA_STAMP := $(VENV)/.media.$(TORCH)
TEST_STAMP := $(VENV)/.test.$(TORCH)

$(MEDIA_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH)" -e ".[media]"
	touch "$@"

$(TEST_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH)" -e ".[test]"
	touch "$@"

# The demo replaces its own output, lipsync_demo.mp4 (git-ignored), so that it can be run again; it is the only
# command here that passes --overwrite, and only for that file.
DEMO_OUTPUT := lipsync_demo.mp4

.PHONY: demo test
demo: $(MEDIA_STAMP)
	$(BIN)/taesd-fast lipsync --output $(DEMO_OUTPUT) --overwrite

test: $(TEST_STAMP)
	$(BIN)/python -m pytest
