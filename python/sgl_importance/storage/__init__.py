"""Storage side: pages that leave the process for SGLang's storage tier.

``page`` (the sealed format), ``encoding`` (8- and 4-bit page classes), ``precision``
(which class a page is sealed at), ``breaker`` (writes pause after failures),
``wrapper`` (seal on write, verify on read), ``file`` and ``mooncake`` (adapters for
SGLang's backends), ``factory`` (the only place that picks an adapter by name) and
``shared_importance`` (page importance stored next to the pages). Storage moves
sealed bytes and knows no eviction policy: nothing here imports ``cache/``."""
