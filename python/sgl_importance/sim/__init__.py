"""Offline cache replay: policies x budgets on recorded or synthetic traces.

Plain numpy; imports neither SGLang nor torch, so it runs anywhere. Entry
point: ``python -m sgl_importance.sim {replay,analyze,synth}``.
"""

from sgl_importance.sim.policies import POLICIES, make_policy
from sgl_importance.sim.policy_base import Policy

__all__ = ["POLICIES", "Policy", "make_policy"]
