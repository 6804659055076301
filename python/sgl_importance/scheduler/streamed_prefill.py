"""Streamed prefill, the scheduler's side: a long prompt's pages leave the device chunk by chunk.

With ``--hot-set-prefill stream`` (the default, on a backend whose extend reads released pages back:
``importance_torch`` and ``importance_triton``) a prompt past ``--hot-set-threshold`` that SGLang
prefills in chunks (``--chunked-prefill-size``) gives its full pages to the host pool after each
chunk, from the hook that already keeps its chunks out of the tree
(``hot_set_release.checkpoint_unless_released``), as moves the residency owner makes (``PageMoves``,
reason ``PREFILL``: one device->host copy; the device pages freed once it is done). Before a page
leaves, the decoder summarises it (``hot_set/prefill.py``). Later chunks attend the released pages
from their host copies (``attention/torch_backend.extend_causal_attention``), and so does the first
decode step, which reads every page; its plan then promotes the hot set. The values read are the
ones the device held, so the output is dense prefill's, and the device holds about one chunk, the
sinks and the window while the prompt prefills. ``importance_triton`` stages each layer's prefixes
for SGLang's Triton kernel (``attention/released_prefix.py``).

On CUDA this runs on the scheduler's stream while, under the overlap scheduler, the chunk's
forward may still run on the model runner's: the summary and the copies out wait for that
stream first; the device pages go back to the allocator once their copy is done
(``PageCopies``), and a later chunk reads the host copies after it (``Residency.read_host``).
Not yet run on a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from sgl_importance.hot_set.pages.state import MoveReason, PageMoves, RequestMoves, RequestPages
from sgl_importance.hot_set.prefill import summarise_prefill
from sgl_importance.hot_set.residency import Residency

if TYPE_CHECKING:
    from sgl_importance.hot_set.decode import HotSetDecoder


def release_chunk(
    residency: Residency,
    decoder: HotSetDecoder,
    forward_stream: Optional[torch.cuda.Stream],
    pages: RequestPages,
    rid: str,
    length: int,
) -> None:
    """Streamed prefill, after a chunk: the request's full pages so far, summarised (the
    decoder's one pass over their keys), go to the host pool but its sinks and its last
    ``window`` full pages (those the next chunk releases); the partial last page stays.
    The next chunk's extend and the first decode step read them from there. ``forward_stream``:
    the model runner's (CUDA), None on the CPU."""
    ps = pages.page_size
    full = length // ps
    if forward_stream is not None:
        # CUDA, under the overlap scheduler: the chunk's forward may still be writing its KV on
        # the model runner's stream; the summary below and the copies out (issued after what
        # this stream has queued) wait for it, as HiCache's own write-through does.
        torch.cuda.current_stream(pages.row.device).wait_stream(forward_stream)
    if not summarise_prefill(decoder, rid, pages.row[:length], full):
        return  # refused key ranges, or a policy that keeps its pages: dense prefill
    params = decoder.request_params.get(rid, decoder.params)
    first, end = max(pages.first_owned_page, params.sinks), full - params.window
    if end > first:
        moves = [RequestMoves(rid, release=torch.arange(first, end))]
        residency.apply(PageMoves(moves, MoveReason.PREFILL))
