"""Kernels for importance-guided KV tiering: decode attention that also returns how
much attention mass each KV page received (Triton, and a batched page-list torch path
for CPUs), the same Triton kernel over a step's page lists (``page_list``), its torch
reference, a scatter of that importance into a per-physical-page table, and the hot-set
guard's page log-masses from 4-bit key codes (``key_codes``), its selection of the rest
pages to read (``guard_select``) and its end in a captured step (``guard_finish``), its
exact reads of a
fixed page list under a page mask (``masked_pages``), its merge of two softmax parts
(``merge``) and its sampled estimate with the bound (``combine``); each a Triton kernel
on a GPU beside its torch path.

Knows nothing of SGLang; it only shares SGLang's KV layout (see ``decode_importance``).
"""

from .key_codes import key_code_pages, key_code_pages_torch
from .masked_pages import (
    PageParts,
    masked_page_attention,
    masked_page_attention_reference,
    masked_page_parts,
    merge_page_parts,
    page_parts,
)
from .merge import merge_parts, merge_parts_torch
from .output import DecodeImportanceOutput
from .paged import (
    PagedDecodePlan,
    PagedDecodeWorkspace,
    decode_importance_paged,
    plan_from_slots,
    plan_from_table,
    plan_paged_decode,
)
from .plan import DecodeGeometry, decode_geometry, default_num_splits, split_bounds
from .reference import decode_importance_reference
from .scatter import HAS_TRITON, scatter_page_importance

__all__ = [
    "HAS_TRITON",
    "DecodeGeometry",
    "DecodeImportanceOutput",
    "PageParts",
    "PagedDecodePlan",
    "PagedDecodeWorkspace",
    "decode_geometry",
    "decode_importance_paged",
    "decode_importance_reference",
    "default_num_splits",
    "key_code_pages",
    "key_code_pages_torch",
    "masked_page_attention",
    "masked_page_parts",
    "masked_page_attention_reference",
    "merge_page_parts",
    "page_parts",
    "merge_parts",
    "merge_parts_torch",
    "plan_from_slots",
    "plan_from_table",
    "plan_paged_decode",
    "scatter_page_importance",
    "split_bounds",
    "t_quantile",
]

from .combine import t_quantile  # noqa: E402 (torch; the module's kernels need Triton)

if HAS_TRITON:
    from .combine import combine_rest_triton, combine_triton
    from .decode_importance import (
        DecodeImportanceWrapper,
        decode_attention_with_importance,
        decode_importance_fwd,
    )
    from .guard_finish import guard_finish_triton
    from .guard_select import guard_select_triton
    from .key_codes import key_code_pages_ranged, key_code_pages_triton
    from .merge import merge_parts_triton
    from .page_list import PageListSlots, TritonPageListDecode, page_list_slots

    __all__ += [
        "DecodeImportanceWrapper",
        "PageListSlots",
        "TritonPageListDecode",
        "combine_rest_triton",
        "combine_triton",
        "decode_attention_with_importance",
        "decode_importance_fwd",
        "guard_finish_triton",
        "guard_select_triton",
        "key_code_pages_ranged",
        "key_code_pages_triton",
        "merge_parts_triton",
        "page_list_slots",
    ]
