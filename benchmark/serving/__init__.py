"""Serving: eviction policies under SGLang's load generator, a shared store, idle CPU; see README.md."""
