"""Production KV-cache traces: read them, sample whole conversations, scale blocks to token ids.

Two formats, one JSON object per line, told apart by their keys:

- Mooncake (FAST'25 release): ``timestamp`` (ms), ``input_length``, ``output_length``
  and ``hash_ids``, one id per 512-token block; ids are prefix hashes (an equal id
  means an equal prefix up to and including that block), the last block partial.
  Conversations are not named: a request belongs to the conversation of its first
  *non-shared* block, a block that fewer than ``shared_share`` of the requests contain
  (the conversation trace's block 0, a system prompt every request starts with, is
  shared; a history re-read by a later turn is not).
- Qwen-Bailian: ``chat_id``, ``parent_chat_id`` (-1 for a first turn), ``turn``,
  ``timestamp`` (s), ``input_length``, ``output_length`` and ``hash_ids`` per 16-token
  block; a conversation is the root of its ``parent_chat_id`` chain.

A slice keeps whole conversations (1 in ``every``, drawn by a stable hash of the
conversation and ``seed``), so a replay sees each conversation's turns. The embedded
model has 8K positions, so each block becomes ``tokens_per_block`` token ids (the last
block in proportion to its share of a block): equal block ids give equal token ids at
the same place, distinct ids distinct token ids, so SGLang's radix tree sees exactly
the trace's prefix sharing. Pure Python; no server.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

MOONCAKE_BLOCK_TOKENS = 512
BAILIAN_BLOCK_TOKENS = 16
# Token ids used for the scaled prompts: above the tokenizer's special tokens, inside
# the vocabulary of the embedded model (49,152).
TOKEN_BASE = 1000
TOKEN_RANGE = 40_000
CONVERSATION_TRACE = "mooncake_conversation_trace.jsonl"
SYNTHETIC_TRACE = "mooncake_synthetic_trace.jsonl"
REPO = Path(__file__).resolve().parents[2]


def shared_trace(name: str = CONVERSATION_TRACE) -> Path:
    """A trace in the shared folder beside the repository (``../shared/traces/<name>``
    from its root), or beside a folder above it (a worktree); the first that exists,
    else the first place looked."""
    places = [folder / "shared" / "traces" / name for folder in REPO.parents]
    return next((p for p in places if p.exists()), places[0])


@dataclass(frozen=True)
class TraceRequest:
    """One request of a production trace.

    Attributes:
        arrival_s: seconds from the trace's start.
        blocks: the prompt's block ids (prefix hashes), in order.
        input_length: prompt tokens in the trace.
        output_length: output tokens in the trace.
        conversation: the conversation's key (see the module docstring).
    """

    arrival_s: float
    blocks: tuple[int, ...]
    input_length: int
    output_length: int
    conversation: int


@dataclass(frozen=True)
class ScaledRequest:
    """A trace request as the replay sends it: token ids, and the pages they fill.

    Attributes:
        arrival_s: seconds from the trace's start.
        conversation: the conversation's key.
        token_ids: the prompt.
        full_blocks: the block ids whose scaled tokens fill a whole page each (the
            last, partial block is left out unless it scales to a full page).
    """

    arrival_s: float
    conversation: int
    token_ids: tuple[int, ...]
    full_blocks: tuple[int, ...]


def read_trace(path: Path, shared_share: float = 0.05) -> tuple[list[TraceRequest], int]:
    """Read a Mooncake or Qwen-Bailian trace, sorted by arrival.

    Args:
        path: the JSON-lines file.
        shared_share: Mooncake only: a block in at least this share of the requests
            is shared (a system prompt), not a conversation's own.

    Returns:
        The requests, and the trace's tokens per block.

    Raises:
        ValueError: a line of neither format.
    """
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        return [], MOONCAKE_BLOCK_TOKENS
    if "chat_id" in rows[0]:
        return _bailian(rows), BAILIAN_BLOCK_TOKENS
    if not {"timestamp", "hash_ids", "input_length"} <= set(rows[0]):
        raise ValueError(f"{path}: neither a Mooncake nor a Qwen-Bailian trace (keys {sorted(rows[0])})")
    return _mooncake(rows, shared_share), MOONCAKE_BLOCK_TOKENS


def _mooncake(rows: list[dict], shared_share: float) -> list[TraceRequest]:
    # A block's request count; ids are prefix hashes, so each request holds a block once.
    count = Counter(h for r in rows for h in r["hash_ids"])
    shared = max(2, math.ceil(shared_share * len(rows)))
    out = []
    for r in rows:
        blocks = tuple(int(h) for h in r["hash_ids"])
        own = next((h for h in blocks if count[h] < shared), blocks[-1] if blocks else -1)
        out.append(
            TraceRequest(r["timestamp"] / 1000.0, blocks, int(r["input_length"]), int(r["output_length"]), int(own))
        )
    out.sort(key=lambda q: q.arrival_s)
    return out


def _bailian(rows: list[dict]) -> list[TraceRequest]:
    parent = {int(r["chat_id"]): int(r.get("parent_chat_id", -1)) for r in rows}

    def root(chat: int) -> int:
        seen = set()
        while parent.get(chat, -1) >= 0 and chat not in seen:
            seen.add(chat)
            chat = parent[chat]
        return chat

    out = [
        TraceRequest(
            float(r["timestamp"]),
            tuple(int(h) for h in r["hash_ids"]),
            int(r["input_length"]),
            int(r["output_length"]),
            root(int(r["chat_id"])),
        )
        for r in rows
    ]
    out.sort(key=lambda q: q.arrival_s)
    return out


def in_slice(conversation: int, every: int, seed: int) -> bool:
    """Whether a conversation is in the 1-in-``every`` slice drawn with ``seed`` (stable
    across processes and Python versions)."""
    digest = hashlib.blake2b(f"{seed}:{conversation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % every == 0


def sample(
    requests: Iterable[TraceRequest], every: int = 8, seed: int = 1, max_requests: Optional[int] = None
) -> list[TraceRequest]:
    """Whole conversations, 1 in ``every`` (``every`` 1: all), in arrival order, the first
    ``max_requests`` of them (None: all)."""
    kept = [r for r in requests if every <= 1 or in_slice(r.conversation, every, seed)]
    return kept[:max_requests] if max_requests is not None else kept


def block_tokens(block: int, n: int) -> list[int]:
    """The first ``n`` token ids of a block: two ids spell the block id (distinct ids give
    distinct pages), the rest a pseudo-random filler drawn from it."""
    head = [TOKEN_BASE + (block // TOKEN_RANGE) % TOKEN_RANGE, TOKEN_BASE + block % TOKEN_RANGE]
    state = (block * 0x9E3779B97F4A7C15 + 1) & 0xFFFFFFFFFFFFFFFF
    tail = []
    for _ in range(max(0, n - 2)):
        state = (state * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        tail.append(TOKEN_BASE + (state >> 33) % TOKEN_RANGE)
    return (head + tail)[:n]


def scale(request: TraceRequest, trace_block_tokens: int, tokens_per_block: int = 16) -> ScaledRequest:
    """The request's prompt as token ids: ``tokens_per_block`` per block, the last block
    (partial in the trace) ``ceil`` of its share."""
    ids: list[int] = []
    full: list[int] = []
    n = len(request.blocks)
    for i, block in enumerate(request.blocks):
        size = tokens_per_block
        if i == n - 1:
            rest = request.input_length - trace_block_tokens * (n - 1)
            size = min(tokens_per_block, max(1, math.ceil(tokens_per_block * rest / trace_block_tokens)))
        ids += block_tokens(block, size)
        if size == tokens_per_block:
            full.append(block)
    return ScaledRequest(request.arrival_s, request.conversation, tuple(ids), tuple(full))


def load_slice(
    path: Path,
    every: int = 8,
    seed: int = 1,
    max_requests: Optional[int] = None,
    tokens_per_block: int = 16,
    max_prompt_tokens: Optional[int] = None,
) -> list[ScaledRequest]:
    """Read, sample and scale: the requests a replay sends, in arrival order.

    ``max_prompt_tokens`` drops requests whose scaled prompt is longer (the model's
    context); whole conversations are sampled first, so a dropped turn's neighbours stay.
    """
    requests, per_block = read_trace(path)
    scaled = [scale(r, per_block, tokens_per_block) for r in sample(requests, every, seed, max_requests)]
    if max_prompt_tokens is not None:
        scaled = [r for r in scaled if len(r.token_ids) <= max_prompt_tokens]
    return scaled


def slice_label(path: Path, every: int, seed: int, max_requests: Optional[int]) -> str:
    """A short name for a slice in tables: ``<trace> 1/8 s1 [first N]``."""
    name = Path(path).stem.replace("mooncake_", "").replace("_trace", "")
    cut = f" first {max_requests}" if max_requests is not None else ""
    return f"{name} 1/{every} s{seed}{cut}" if every > 1 else f"{name}{cut}"


def write_mooncake(path: Path, requests: Sequence[dict]) -> None:
    """Write rows in the Mooncake format (tests build small traces with it)."""
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in requests))


def turn_statistics(requests: Sequence[TraceRequest], last_turn: int = 7) -> list[dict]:
    """Per turn of a conversation (turns past ``last_turn`` counted with it): requests,
    the share followed by another turn of the same conversation, and the median gap
    to it in seconds. What a priority built from a node's re-reads can know."""
    turns: dict[int, list[TraceRequest]] = {}
    for r in requests:
        turns.setdefault(r.conversation, []).append(r)
    rows: dict[int, dict] = {}
    for rs in turns.values():
        for k, r in enumerate(rs):
            row = rows.setdefault(min(k + 1, last_turn), {"requests": 0, "followed": 0, "gaps": []})
            row["requests"] += 1
            if k + 1 < len(rs):
                row["followed"] += 1
                row["gaps"].append(rs[k + 1].arrival_s - r.arrival_s)
    out = []
    for turn in sorted(rows):
        row = rows[turn]
        gaps = sorted(row["gaps"])
        out.append(
            {
                "turn": turn,
                "requests": row["requests"],
                "followed": row["followed"] / row["requests"],
                "median_gap_s": gaps[len(gaps) // 2] if gaps else float("nan"),
            }
        )
    return out
