"""Names of the environment variables the plugin reads or sets, one constant each.

A leaf with no imports, so ``plugin.load()`` can test a variable in every process
before it imports anything heavier.
"""

from __future__ import annotations

# Ours.
# Set by the launcher from --importance-trace-dir; the scheduler records a trace there.
TRACE_DIR_ENV = "SGL_IMPORTANCE_TRACE_DIR"
# Opt-in debug dump of the page-importance table after each step.
DUMP_DIR_ENV = "SGL_IMPORTANCE_DUMP_DIR"
# "1": each process prints a line when the plugin loads.
ANNOUNCE_ENV = "SGL_IMPORTANCE_ANNOUNCE"
# Which dense decode the torch backend runs (paged, torch, reference).
DECODE_ENV = "SGL_IMPORTANCE_DECODE"
# "1": invariant checks the test suite turns on in every server it starts (who holds each
# host slot, hot_set/pages/host_ledger.py; no page moved inside a decode forward). Off: no cost.
CHECKS_ENV = "SGL_IMPORTANCE_CHECKS"

# SGLang's.
PLATFORM_ENV = "SGLANG_PLATFORM"
# "1": SGLang's launcher does not require the sglang-kernel distribution on CUDA (torch_cuda sets it).
SKIP_KERNEL_VERSION_CHECK_ENV = "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"
FILE_STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
MOONCAKE_CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"

# Mooncake's (read by its client inside SGLang's mooncake storage backend).
MOONCAKE_MASTER_ENV = "MOONCAKE_MASTER"
MOONCAKE_CLIENT_ENV = "MOONCAKE_CLIENT"
MOONCAKE_PROTOCOL_ENV = "MOONCAKE_PROTOCOL"
MOONCAKE_METADATA_SERVER_ENV = "MOONCAKE_TE_META_DATA_SERVER"
MOONCAKE_SEGMENT_SIZE_ENV = "MOONCAKE_GLOBAL_SEGMENT_SIZE"
MOONCAKE_HOSTNAME_ENV = "MOONCAKE_LOCAL_HOSTNAME"
MOONCAKE_METRICS_PORT_ENV = "MOONCAKE_MASTER_METRICS_PORT"
