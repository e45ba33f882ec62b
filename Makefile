# The README commands: `make main` (train + evaluate the toy Mask R-CNN on CPU), `make seg`
# (the same for the toy UperNet, semantic segmentation), `make pretrain` (pretrain the
# backbone on toy shapes, convert it, and train + evaluate the toy Mask R-CNN from it) and
# `make test` (ruff, then the whole test suite; CI runs it). `make test-fast` is ruff and the
# tests not marked `slow` outside tests/dev (none trains, builds with pip or takes more than
# ~10 s; under 3 minutes on 2 cores), `make lint` ruff alone. `make smoke-fullsize` runs the
# full-size configs for two iterations on synthetic 1333x800 images (docs/full_size.md).
# `make ablate` trains the attention variants on the long-range toy task, 5 seeds each, and
# writes the table, plot and JSON to work_dirs/ablate (docs/results.md, Ablations;
# ABLATE_ARGS=... adds or overrides tools/ablate.py options).
# Each sets up the environment first, idempotently.
VENV ?= $(CURDIR)/.venv
export LAPFORMER_VENV := $(VENV)
# The tests fail, rather than skip, when the install step did not build the CPU kernels.
test test-fast: export LAPFORMER_REQUIRE_CPU_EXT := 1

# The opt-in ONNX Runtime op library (docs/deploy.md) needs ONNX Runtime's C API headers:
# `make ort-ops ORT_INCLUDE_DIR=DIR`; by default the copy in ../shared beside the checkout.
# The suite runs on every core (pytest-xdist, a file's tests on one worker: tests/conftest.py);
# `make test XDIST=` runs it in one process. --no-loadscope-reorder keeps conftest.py's
# longest-files-first order, which xdist otherwise replaces by the number of tests per file.
XDIST ?= -n auto --dist loadfile --no-loadscope-reorder

ORT_INCLUDE_DIR ?= $(CURDIR)/../shared/third_party/onnxruntime-1.29/include

.PHONY: env main seg pretrain smoke-fullsize ablate lint test test-fast ort-ops

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

# One thread per run, as the job scripts (immune to OpenMP over-subscription when the
# machine is shared), and as many runs at once as the machine has cores.
ablate: env
	@$(VENV)/bin/python tools/ablate.py --task same_colour \
		--variants default gaussian none cg cg_capped lam=1,2,8 --seeds 5 --steps 250 \
		--warmup 100 --val-size 1000 --threads $${LAPFORMER_NUM_THREADS:-1} \
		--jobs $${LAPFORMER_JOBS:-$$(nproc)} \
		--out work_dirs/ablate $(ABLATE_ARGS)

lint: env
	@$(VENV)/bin/ruff check .

test: env lint
	@$(VENV)/bin/python -m pytest -q -ra $(XDIST) $(PYTEST_ARGS)

test-fast: env lint
	@$(VENV)/bin/python -m pytest -q -ra -m "not slow" --ignore=tests/dev $(XDIST) $(PYTEST_ARGS)

ort-ops: env
	@$(VENV)/bin/python tools/build_ort_ops.py --ort-include "$(ORT_INCLUDE_DIR)"
