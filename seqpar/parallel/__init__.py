"""Tensor, sequence, pipeline and data parallelism: groups, the paper's conjugate operators,
parallel layers, vocab-parallel cross entropy and dropout RNG regions."""
