"""zl: fine-tune LLMs with LoRA on a pipeline of devices (phones), no stage waiting on another: the final loss's
gradient comes back up as it arrives (`--schedule async`), with a flush (gpipe, 1f1b), or each stage learns from
its local loss (zerolock).

The command line (the top layer; nothing imports it). The base layer is zl_base/.
"""

from zl_base import __version__  # noqa: F401 (zl.__version__)
