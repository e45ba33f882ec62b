"""Ablations of the attention options (``tools/ablate.py``, :mod:`lapformer_mm.cli.ablate`):
synthetic tasks (:mod:`.tasks`), variant names (:mod:`.variants`), one toy training run
(:mod:`.toy`), the report (:mod:`.report`) and the sweep on real configs (:mod:`.real`).
Not imported by ``import lapformer_mm``.
"""
