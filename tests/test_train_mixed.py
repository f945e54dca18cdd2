"""bf16 compute with fp32 master weights and fp32 gradient accumulation tracks the fp32 run."""

import torch

from seqpar.train.config import build_job
from seqpar.train.loop import Trainer


def _sections(out, dtype):
    return {
        "model": {
            "vocab_size": 256,
            "hidden_size": 32,
            "num_heads": 4,
            "num_layers": 2,
            "seq_len": 16,
            "dtype": dtype,
            "embd_dropout": 0.0,
            "attn_dropout": 0.0,
            "hidden_dropout": 0.0,
        },
        "train": {
            "steps": 4,
            "warmup": 2,
            "micro_batch": 2,
            "global_batch": 6,
            "eval_batches": 1,
            "peak_tflops": 1.0,
            "progress": False,
            "plot": False,
            "out_dir": str(out),
        },
    }


def test_bf16_masters_and_accumulation(tmp_path):
    ref = Trainer(build_job(_sections(tmp_path / "fp32", "fp32")), quiet=True).run()["losses"]
    trainer = Trainer(build_job(_sections(tmp_path / "bf16", "bf16")), quiet=True)
    assert trainer.opt.mixed
    assert all(m.dtype == torch.float32 for m in trainer.opt.masters)
    assert all(p.dtype == torch.bfloat16 for _, p in trainer.opt.named)
    losses = trainer.run()["losses"]
    worst = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
    assert worst < 0.05, worst
    # the model holds the masters rounded to bf16
    for (_, p), m in zip(trainer.opt.named, trainer.opt.masters, strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))
