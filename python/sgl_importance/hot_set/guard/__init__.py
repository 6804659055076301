"""Page summaries and the guard's bound on what a step leaves unread.

``key_ranges.py`` (each full page's key min/max) and ``key_codes.py`` (its 4-bit key codes)
are written once, when a page fills; ``estimate.py`` estimates the unread pages of a layer
from them and from the request's page sample, with a bound on the layer's output error;
``layer.py`` is one guarded layer: the pages its query heads want read exactly, the rest
estimated, the layer-step flagged when the bound is over the threshold.
"""
