"""Release and promote pages as any source does: ``PageMoves`` handed to the owner."""

from __future__ import annotations

import torch

from sgl_importance.hot_set.pages.state import PageMoves, RequestMoves, RequestPages
from sgl_importance.hot_set.residency import Residency


def release(residency: Residency, wanted: list[tuple[RequestPages, torch.Tensor]]) -> None:
    residency.apply(PageMoves([RequestMoves(pages.owner, release=logical) for pages, logical in wanted]))


def promote(residency: Residency, wanted: list[tuple[RequestPages, torch.Tensor]]) -> None:
    residency.apply(PageMoves([RequestMoves(pages.owner, promote=logical) for pages, logical in wanted]))
