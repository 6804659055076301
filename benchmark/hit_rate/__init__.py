"""Hit rate of the eviction policies on recorded and synthetic traces; see RESULTS.md."""
