"""Ablations of the attention options: toy tasks, the sweep and its report.

``tools/ablate.py`` (:mod:`lapformer_mm.cli.ablate`) is the command. The parts:

- :mod:`.tasks`: synthetic tasks made on the fly from a seed (``--task``);
- :mod:`.variants`: variant names (``--variants``) to backbone ``attn_cfg`` dicts;
- :mod:`.toy`: one training run of the small LaplacianFormer classifier on a task;
- :mod:`.report`: the table, the loss-curve plot and the JSON of a sweep;
- :mod:`.real`: the same variants, backbone peers and extra configs on a real
  classification, segmentation or detection config (configs, commands, and the metrics
  of the finished work_dirs).

Not imported by ``import lapformer_mm``; matplotlib is imported only to draw the plot.
"""
