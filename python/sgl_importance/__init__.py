"""sgl-importance: importance-guided KV cache tiering for SGLang.

Importing this package does nothing; SGLang calls ``plugin.load`` through the
``sglang.srt.plugins`` entry point in each of its processes.
"""

__version__ = "0.1.0"
