"""Recorded page-access traces: the on-disk format lives in ``trace.format``."""
