"""Recorded page-access traces, one module per job.

- ``schema``: the on-disk layout (files, columns, types, "unknown" values, sidecar);
- ``tables``: the tables in memory (:class:`Accesses`, :class:`Requests`, :class:`TraceSet`);
- ``table_io``: reading and writing whole tables and the sidecar;
- ``streaming``: :class:`TraceWriter`, appending rows under a row-count bound;
- ``splits``: rewriting paths recorded before a radix split (``resolve_splits``);
- ``recorder``: the scheduler side of ``--importance-trace-dir``;
- ``writer_process``: the process that receives the recorder's batches and writes them.
"""
