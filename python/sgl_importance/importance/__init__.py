"""Page importance: the per-physical-page table decode writes into, and what builds on it."""
