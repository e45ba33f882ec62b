"""Atomic local writes as an mmengine file backend: ``backend_args=dict(backend='atomic_local')``.

mmengine's ``save_checkpoint`` serialises into memory and hands the bytes to its file
backend's ``put``. ``LocalBackend.put`` opens the final path with ``'wb'`` and writes in
place, so a run killed during the write (SIGKILL, OOM killer, preemption) leaves a truncated
``epoch_N.pth`` where the previous one was, and ``--resume`` cannot read it.
:class:`AtomicLocalBackend` writes a temporary file next to the target and renames it over
the target, so a reader sees the old file or the whole new one.

Registered under a name only (no URI prefix): it is used where ``backend_args`` names it,
and mmengine's choice of backend for every other path stays as it was.
"""
import os

from mmengine.fileio import LocalBackend, register_backend


def atomic_write_bytes(data, filepath):
    """Write ``data`` to ``filepath`` so that a reader sees the old file or the whole new one.

    The bytes go to a temporary file in the same directory, are flushed and fsynced, and
    then renamed over ``filepath`` (``os.replace`` is atomic on POSIX and Windows within
    one file system). A process killed mid-write leaves only a stray ``.tmp`` file.
    """
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
    """mmengine's ``LocalBackend`` whose writes replace the target atomically.

    Reads, listing, ``remove`` and the rest are ``LocalBackend``'s. Select it for
    checkpoints with ``CheckpointHook(backend_args=dict(backend='atomic_local'))``
    (``SafeCheckpointRunner`` does this for a local checkpoint directory).
    """

    def put(self, obj, filepath):
        """Write the bytes ``obj`` to ``filepath`` through :func:`atomic_write_bytes`."""
        atomic_write_bytes(obj, filepath)

    def put_text(self, obj, filepath, encoding='utf-8'):
        """Write the string ``obj`` to ``filepath`` through :func:`atomic_write_bytes`."""
        atomic_write_bytes(obj.encode(encoding), filepath)
