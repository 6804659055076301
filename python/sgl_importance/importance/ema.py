"""The one moving average of persistent importance, torch-free.

Shared by the radix nodes (``importance/aggregator.py``), the per-request hot set
(``hot_set/plan/selection.py``) and the simulator's replay of the shipped policy
(``sim/shipped.py``), so a replay folds exactly as the server does. Plain Python:
it works on floats, numpy arrays and tensors alike.
"""

from __future__ import annotations

from typing import Any


def ema_fold(old: Any, value: Any, keep: float) -> Any:
    """``old * keep + value * (1 - keep)``; ``keep = decay ** steps`` for ``steps``
    recorded steps folded at once."""
    return old * keep + value * (1.0 - keep)
