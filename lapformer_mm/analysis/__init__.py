"""Analysis helpers for the command-line tools and benchmarks (not imported by ``lapformer_mm``).

- :mod:`.model_zoo`: the backbones compared (LaplacianFormer, mmdet's PVTv2 and Swin) and
  models built from detector/segmentor configs;
- :mod:`.qk_capture`: forward hooks that record every attention call's queries and keys;
- :mod:`.tail_stats`: query–key distances and their tail statistics;
- :mod:`.qk_distances`, :mod:`.attention_maps`: the two studies of ``docs/analysis.md``;
- :mod:`.images`: synthetic or folder images, ImageNet-normalised;
- :mod:`.flops`: FLOP counting with mmengine's ``FlopAnalyzer``, handles for the custom ops;
- :mod:`.landmark_solve`: residuals of the landmark solve on real activations;

Heavy dependencies (mmdet, matplotlib, OpenCV) are imported inside the functions that use them.
"""
