"""The device pool's turnover: SGLang's access ticks mapped to KV tokens inserted since.

SGLang stamps a radix node's ``last_access_time`` from a logical counter that moves
once per node touched or created, whatever the node's size, so an age in ticks says
little about how much of the pool has been replaced since. The ``credit`` form of
the eviction priority (``importance/priority.py``) measures age in *pool
turnovers* instead: the KV tokens the tree inserted after the node's last access,
divided by the device pool's tokens. LRU is unchanged by the change of clock (the
map is monotone); a credit in turnovers means the same thing at any pool size and
any request rate.

:class:`TurnoverClock` keeps one ``(tick, cumulative tokens)`` entry per new leaf
(``cache/components.py`` records it when SGLang commits an insert) and answers
"tokens inserted up to tick t" with a binary search. It keeps the last
``capacity`` entries at least; a tick older than every entry kept reads as the
newest dropped entry's count (such a node is many turnovers old either way). Plain Python: no SGLang, no torch.
"""

from __future__ import annotations

from bisect import bisect_right

# Entries kept: one per new leaf (about one per request), so hours of traffic.
CAPACITY = 1 << 16


class TurnoverClock:
    """Cumulative KV tokens inserted, indexed by SGLang's access clock.

    Args:
        capacity: entries kept at least (the older half is dropped at twice this).
    """

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._capacity = capacity
        self._ticks: list[float] = []
        self._tokens: list[float] = []
        # The count at the newest dropped entry: what a tick older than all kept reads.
        self._floor = 0.0
        self.total = 0.0
        # The device pool's tokens (set by the FULL component once the cache exists).
        self.pool_tokens = 0.0

    def record(self, tick: float, tokens: int) -> None:
        """``tokens`` of new KV entered the tree at ``tick`` (ticks never go back)."""
        self.total += tokens
        if self._ticks and tick <= self._ticks[-1]:
            # Same or an earlier tick (a clock read late): fold into the last entry.
            self._tokens[-1] = self.total
            return
        self._ticks.append(float(tick))
        self._tokens.append(self.total)
        if len(self._ticks) > 2 * self._capacity:
            cut = len(self._ticks) - self._capacity
            self._floor = self._tokens[cut - 1]
            del self._ticks[:cut], self._tokens[:cut]

    def inserted_at(self, tick: float) -> float:
        """Tokens inserted up to and including ``tick``."""
        i = bisect_right(self._ticks, tick)
        return self._tokens[i - 1] if i else self._floor

    def pools_since(self, tick: float) -> float:
        """Device pools' worth of tokens inserted after ``tick`` (0 before the pool
        size is known)."""
        if self.pool_tokens <= 0.0:
            return 0.0
        return (self.total - self.inserted_at(tick)) / self.pool_tokens
