"""Names of the environment variables the plugin reads (placeholder until the config branch lands)."""

DUMP_DIR_ENV = "SGL_IMPORTANCE_DUMP_DIR"
TRACE_DIR_ENV = "SGL_IMPORTANCE_TRACE_DIR"
PLATFORM_ENV = "SGLANG_PLATFORM"
ANNOUNCE_ENV = "SGL_IMPORTANCE_ANNOUNCE"
