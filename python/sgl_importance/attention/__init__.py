"""Attention backends whose decode also returns page importance.

``importance_torch`` (CPU, subclass of SGLang's ``TorchNativeAttnBackend``) and
``importance_triton`` (GPU, subclass of ``TritonAttnBackend``): prefill/extend are
their parents', decode computes the same attention with ``sgl_kernel_ext`` and files
each layer's page importance in the process's ``PageImportanceTable``.
``plugin.py`` registers them by name.
"""
