"""Cache side: the ``importance`` eviction strategy and the FULL tree component that
keeps node importance through splits."""
