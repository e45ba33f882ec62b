# The README commands: `make main` (train + evaluate the toy Mask R-CNN on CPU), `make seg`
# (the same for the toy UperNet, semantic segmentation), `make pretrain` (pretrain the
# backbone on toy shapes, convert it, and train + evaluate the toy Mask R-CNN from it) and
# `make test` (the test suite).
# Each sets up the environment first, idempotently.
VENV ?= $(CURDIR)/.venv
export LAPFORMER_VENV := $(VENV)

.PHONY: env main seg pretrain test

env:
	@tools/setup_env.sh

main: env
	@PATH="$(VENV)/bin:$$PATH" tools/main_job.sh

seg: env
	@PATH="$(VENV)/bin:$$PATH" tools/seg_job.sh

pretrain: env
	@PATH="$(VENV)/bin:$$PATH" tools/pretrain_job.sh

test: env
	@$(VENV)/bin/python -m pytest -q -ra $(PYTEST_ARGS)
