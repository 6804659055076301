"""The hot-set step in fixed shapes, for a CUDA graph.

``step.py`` plans a step into fixed-size buffers and runs its layers; ``guard.py`` is the
guard's layers in the same shapes; ``late_ends.py`` holds a step ended one step late
(``--hot-set-plan-ahead``).
"""
