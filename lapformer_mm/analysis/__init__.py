"""Analysis helpers of the command-line tools and benchmarks (not imported by
``lapformer_mm``; mmdet, matplotlib and OpenCV are imported where used)."""
