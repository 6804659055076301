"""Scheduler side: work done in SGLang's scheduler loop between batches."""
