"""AOT side of zl: model sources, stage split, LoRA, the local loss, export to ExecuTorch, data shards."""
