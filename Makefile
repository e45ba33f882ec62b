# The two README commands: `make main` (train + evaluate the toy Mask R-CNN on CPU) and
# `make test` (the test suite). Both set up the environment first, idempotently.
VENV ?= $(CURDIR)/.venv
export LAPFORMER_VENV := $(VENV)

.PHONY: env main test

env:
	@tools/setup_env.sh

main: env
	@PATH="$(VENV)/bin:$$PATH" tools/main_job.sh

test: env
	@$(VENV)/bin/python -m pytest -q -ra $(PYTEST_ARGS)
