"""The command-line tools' code, importable; ``tools/*.py`` are thin entry points.

Each module has ``main(argv=None)`` returning an exit code. Not imported by
``import lapformer_mm``.
"""
