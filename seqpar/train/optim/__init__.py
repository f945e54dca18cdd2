"""The optimizers: AdamW on fp32 masters (replicated, ZeRO-1 distributed, on FSDP shards), lr and
loss scale."""
