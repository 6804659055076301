"""Decode kernels with page importance on a GPU (or, ``--smoke``, under the Triton interpreter); see README.md."""
