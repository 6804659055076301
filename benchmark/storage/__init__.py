"""The storage tier: page integrity and page encoding; see RESULTS.md."""
