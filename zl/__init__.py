"""zl: fine-tune LLMs with LoRA on a pipeline of devices, without backpropagation across them.

The command line (the top layer; nothing imports it). The base layer is zl_base/.
"""

from zl_base import __version__  # noqa: F401 (zl.__version__)
