# The README commands: `make main` (train + evaluate the toy Mask R-CNN on CPU), `make seg`
# (the same for the toy UperNet, semantic segmentation), `make pretrain` (pretrain the
# backbone on toy shapes, convert it, and train + evaluate the toy Mask R-CNN from it) and
# `make test` (the test suite). `make smoke-fullsize` runs the full-size configs for two
# iterations on synthetic 1333x800 images (docs/full_size.md).
# Each sets up the environment first, idempotently.
VENV ?= $(CURDIR)/.venv
export LAPFORMER_VENV := $(VENV)

.PHONY: env main seg pretrain smoke-fullsize test

env:
	@tools/setup_env.sh

main: env
	@PATH="$(VENV)/bin:$$PATH" tools/main_job.sh

seg: env
	@PATH="$(VENV)/bin:$$PATH" tools/seg_job.sh

pretrain: env
	@PATH="$(VENV)/bin:$$PATH" tools/pretrain_job.sh

smoke-fullsize: env
	@$(VENV)/bin/python tools/smoke_fullsize.py

test: env
	@$(VENV)/bin/python -m pytest -q -ra $(PYTEST_ARGS)
