"""The benchmarks, one folder per question, each script a module run from the
repository root: ``python -m benchmark.<folder>.<script> [--help]``. Scripts share
code by package imports (``from benchmark.long_context.bench_hot_set import ...``);
the server, the model and the requests come from ``sgl_importance.local_server``
and ``sgl_importance.client``."""
