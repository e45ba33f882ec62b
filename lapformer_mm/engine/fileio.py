"""Atomic local writes as an mmengine file backend: ``backend_args=dict(backend='atomic_local')``.

mmengine's ``LocalBackend.put`` writes a checkpoint in place, so a run killed during the
write (SIGKILL, OOM killer, preemption) leaves a truncated ``epoch_N.pth`` that ``--resume``
cannot read. Registered under a name only (no URI prefix): mmengine's choice of backend for
every other path stays as it was.
"""
import os

from mmengine.fileio import LocalBackend, register_backend


def atomic_write_bytes(data, filepath):
    """Write ``data`` to ``filepath`` so that a reader sees the old file or the whole new one:
    a fsynced temporary file in the same directory, renamed over it (``os.replace`` is
    atomic within one file system); a kill mid-write leaves only a stray ``.tmp`` file."""
    filepath = os.fspath(filepath)
    directory = os.path.dirname(os.path.abspath(filepath))
    os.makedirs(directory, exist_ok=True)
    tmp_path = os.path.join(directory,
                            f'.{os.path.basename(filepath)}.{os.getpid()}.tmp')
    try:
        with open(tmp_path, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, filepath)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


@register_backend('atomic_local')
class AtomicLocalBackend(LocalBackend):
    """mmengine's ``LocalBackend`` whose writes replace the target atomically
    (``SafeCheckpointRunner`` selects it for a local checkpoint directory)."""

    def put(self, obj, filepath):
        atomic_write_bytes(obj, filepath)

    def put_text(self, obj, filepath, encoding='utf-8'):
        atomic_write_bytes(obj.encode(encoding), filepath)
