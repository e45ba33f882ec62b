# lapformer_mm's runtime fragment: every config here lists it in _base_; it works
# with mmdet, mmseg and mmpretrain configs alike.
#
# custom_imports registers the backbone and lapformer_mm's opt-in engine parts
# (lapformer_mm/engine); runner_type selects SafeCheckpointRunner, which
#   - reads local checkpoints (load_from, --resume, tools/test.py) with
#     torch.load(weights_only=True) and names a refused file,
#   - auto-resumes (--resume without a path) past an empty or stale last_checkpoint,
#   - builds the CheckpointHook of default_hooks as SafeCheckpointHook (the
#     checkpoint that falls out of max_keep_ckpts is deleted last), writing through
#     the atomic_local file backend (temporary file, then rename).
# The hook is chosen by the runner rather than set here because mmengine forbids
# one key in two _base_ files, and each codebase's runtime or schedule already
# sets default_hooks.
custom_imports = dict(imports=['lapformer_mm'], allow_failed_imports=False)
runner_type = 'SafeCheckpointRunner'
