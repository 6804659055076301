"""``python -m sgl_importance.platform.cuda_shim``: print the folder to put on PYTHONPATH."""

from sgl_importance.platform.cuda_shim import shim_dir

print(shim_dir())
