"""Offline cache replay: policies x budgets on recorded or synthetic traces.

Plain numpy; imports neither SGLang nor torch, so it runs anywhere. Entry
point: ``python -m sgl_importance.sim {replay,analyze,synth}``.
"""

from sgl_importance.sim import belady as _belady  # noqa: F401  (registers "belady")
from sgl_importance.sim import shipped as _shipped  # noqa: F401  (registers "shipped")
from sgl_importance.sim.policies import POLICIES, Policy, make_policy, register

__all__ = ["POLICIES", "Policy", "make_policy", "register"]
