"""SGLang's server arguments as the plugin reads them (in the scheduler and the HTTP process)."""

from __future__ import annotations

from typing import Optional, Protocol


class ServerArgs(Protocol):
    """``server_args.ServerArgs``: the server's flags."""

    model_path: str
    served_model_name: Optional[str]
    page_size: Optional[int]  # tokens per page (set before the scheduler starts)
    attention_backend: Optional[str]
    decode_attention_backend: Optional[str]  # None: ``attention_backend``'s
    radix_eviction_policy: str
    enable_metrics: bool
