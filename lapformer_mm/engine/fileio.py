"""Atomic local writes as an mmengine file backend, ``backend_args=dict(backend='atomic_local')``:
mmengine's ``LocalBackend.put`` writes in place, so a run killed mid-write leaves a truncated
checkpoint. Registered by name only: no other path changes backend."""
import os

from mmengine.fileio import LocalBackend, register_backend


def atomic_write_bytes(data, filepath):
    """Write ``data`` to ``filepath`` so that a reader sees the old file or the whole new one:
    a fsynced temporary file renamed over it (a kill leaves a stray ``.tmp``)."""
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

    def put(self, obj, filepath):
        atomic_write_bytes(obj, filepath)

    def put_text(self, obj, filepath, encoding='utf-8'):
        atomic_write_bytes(obj.encode(encoding), filepath)
