"""Checks over the package's own source (import graph, module state); no SGLang."""
