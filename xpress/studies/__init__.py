"""Studies: measured comparisons that sit above the models, the targets, the decoding engine and
training (they may import all of them; nothing below imports this package). Figures are drawn from
their result files by :mod:`xpress.plots`.
"""
