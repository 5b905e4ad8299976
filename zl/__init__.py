"""zl: fine-tune LLMs with LoRA on a pipeline of devices, without backpropagation across them."""

__version__ = "0.1.0"
