"""Analysis helpers of the command-line tools and benchmarks (not imported by
``lapformer_mm``; mmdet, matplotlib and OpenCV are imported where used)."""


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, imported where a plot is drawn."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt
