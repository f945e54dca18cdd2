"""The paper's GPT (Fig. 2) built from tensor/sequence-parallel layers, sequence-first [s, b, h]."""

from seqpar.model.gpt import GPTStage, build_model

__all__ = ["GPTStage", "build_model"]
