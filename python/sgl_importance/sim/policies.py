"""The replay's eviction policies by name, :func:`make_policy`, which builds one from a spec,
and :func:`replay_points`, the (policy, budget) points both regimes' replays run.

The policy the server runs is ``shipped`` (``sim/shipped.py``: the server's own
priority function, ranked at eviction time). ``decayed_mass`` (a decayed sum of
attention mass) and ``blend`` (that sum blended with recency) are research
variants under their own names; a verdict about them is not about the server.

Specs: ``"name"`` or ``"name:param=value:param=value"`` (see :func:`make_policy`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from sgl_importance.sim.belady import Belady, ReReadOracle
from sgl_importance.sim.mass_policies import H2O, Blend, DecayedMass, PrefetchDecayedMass
from sgl_importance.sim.policy_base import Policy
from sgl_importance.sim.recency_policies import LFU, LRU, SLRU, TLRU, LRUMass, SGLangSLRU
from sgl_importance.sim.shipped import Shipped


def _by_name(*classes: type[Policy]) -> Mapping[str, type[Policy]]:
    """A read-only map from each class's ``name`` to the class; a name given twice is an error."""
    table: dict[str, type[Policy]] = {}
    for cls in classes:
        if not cls.name or cls.name in table:
            raise ValueError(f"policy {cls.__name__}: name {cls.name!r} is empty or taken")
        table[cls.name] = cls
    return MappingProxyType(table)


# Every policy a spec may name, in the order reports list them by default.
POLICIES: Mapping[str, type[Policy]] = _by_name(
    LRU,
    LRUMass,
    LFU,
    TLRU,
    H2O,
    DecayedMass,
    Blend,
    SLRU,
    PrefetchDecayedMass,
    Belady,
    Shipped,
    SGLangSLRU,
    ReReadOracle,
)


def make_policy(spec: str) -> Policy:
    """Build a policy from ``"name"`` or ``"name:param=value[:param=value...]"``."""
    name, *parts = spec.strip().split(":")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    params = {}
    for part in parts:
        if "=" not in part:
            raise ValueError(f"policy spec {spec!r}: expected param=value, got {part!r}")
        k, v = part.split("=", 1)
        params[k.strip()] = v.strip() if POLICIES[name].raw_params else float(v)
    return POLICIES[name](**params)


def replay_points(
    regime: str, policies: Sequence[str | Policy], budget_fracs: Iterable[float]
) -> list[tuple[Policy, float]]:
    """The (policy, budget fraction) points a replay in ``regime`` (``hot`` or ``prefix``)
    runs, policy by policy; a policy given as a spec is built with :func:`make_policy`.

    Raises:
        ValueError: a fraction outside (0, 1], or a policy that does not replay ``regime``.
    """
    fracs = [float(f) for f in budget_fracs]
    for f in fracs:
        if not 0.0 < f <= 1.0:
            raise ValueError(f"budget fraction {f} out of range (0, 1]")
    pols = [make_policy(p) if isinstance(p, str) else p for p in policies]
    for p in pols:
        if regime not in p.regimes:
            raise ValueError(f"policy {p.label!r} does not support the {regime} regime")
    return [(p, f) for p in pols for f in fracs]
