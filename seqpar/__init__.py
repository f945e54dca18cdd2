"""seqpar: tensor, sequence and pipeline parallel transformer training with selective
activation recomputation, after Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models" (arXiv 2205.05198)."""

__version__ = "0.1.0"
