"""Sharded, layout-free checkpoints: each rank writes and reads only its own chunks (offsets in the
full tensor), each chunk once over the ranks; the stored tensors are the full single-process ones at
any tp (grouped QKV with fewer kv heads than ranks, a padded vocabulary, [gate; up]); no rank
allocates a full tensor of a split parameter or of its Adam state; checkpoints of the previous
format load."""

import json

import torch
import torch.distributed.checkpoint as dcp
from _helpers import LargestAllocation

from seqpar.parallel.launch import run_ranks
from seqpar.train import checkpoint as ckpt
from seqpar.train.config import build_job

# kv heads 2 < tp 4, vocabulary 250 padded to 252 at tp 4, SwiGLU, untied output layer
MODEL = {
    "vocab_size": 250,
    "hidden_size": 32,
    "num_heads": 4,
    "kv_heads": 2,
    "num_layers": 2,
    "seq_len": 16,
    "norm": "rmsnorm",
    "activation": "swiglu",
    "position": "rope",
    "bias": False,
    "tie_embeddings": False,
    "embd_dropout": 0.0,
    "attn_dropout": 0.0,
    "hidden_dropout": 0.0,
}
TRAIN = {"steps": 2, "lr": 3e-3, "warmup": 1, "micro_batch": 2, "global_batch": 4, "eval_every": 0,
         "eval_batches": 1, "log_every": 10, "peak_tflops": 1.0, "progress": False, "plot": False}


def sections(out, tp=1, **train):
    return {"model": MODEL, "parallel": {"tp": tp, "sp": tp > 1}, "recompute": {},
            "train": {**TRAIN, "out_dir": str(out), **train}}


def _largest_floating() -> LargestAllocation:
    """The largest floating-point tensor an op makes (the byte tensors of DCP's pickled plans and
    the meta-device model a load checks shapes on do not count)."""
    return LargestAllocation(lambda t: t.is_floating_point() and t.device.type != "meta")


def _train_save_load(rank, world, out, tp, resume):
    """Train 2 steps at ``tp`` (resuming from ``resume`` if given), save, read it back into fresh
    tensors; report the shards, the largest allocation during save and load, and the full split
    sizes."""
    from seqpar.parallel.layout import layout_of
    from seqpar.parallel.sharding import full_shape
    from seqpar.train.loop import Trainer

    more = {"steps": TRAIN["steps"] + 1} if resume else {}  # a resume with no steps left is refused
    trainer = Trainer(build_job(sections(out, tp, **more)), resume=resume, quiet=True)
    if not resume:
        for step in (1, 2):
            trainer.state.step = step
            trainer.train_step(step)
    states = trainer.opt.local_state()
    with _largest_floating() as saving:
        path = trainer.save()
    local = {name: {k: v.clone() for k, v in t.items()} for name, _, t in states}
    for _, _, tensors in states:
        for value in tensors.values():
            value.zero_()
    with _largest_floating() as loading:
        ckpt.load_shards(ckpt.resolve(path), trainer.opt.checkpoint_views(saving=False))
    reloaded = all(torch.equal(local[name][k], v) for name, _, t in states for k, v in t.items())
    split = [
        torch.Size(full_shape(p, tp)).numel()
        for _, p, _ in states
        if layout_of(p).split_dim is not None
    ]
    return {
        "path": path,
        "local": local,
        "reloaded": reloaded,
        "save_largest": saving.largest,
        "load_largest": loading.largest,
        "ops": (saving.op, loading.op),
        "largest_full_split": max(split),
        "largest_local": max(p.numel() for _, p, _ in states),
        "params": {name: (p.numel(), layout_of(p).split_dim is not None) for name, p, _ in states},
    }


def _full(path):
    """Every stored tensor, read whole by this process."""
    shapes = ckpt.stored_keys(path)
    return ckpt.load_full(path, shapes, local=True)


def test_tp4_save_is_the_full_model_written_once_and_loads_at_tp2_and_tp1(tmp_path):
    results = run_ranks(_train_save_load, 4, str(tmp_path / "tp4"), 4, "")
    path = ckpt.resolve(results[0]["path"])
    assert all(r["reloaded"] for r in results)
    # while saving or loading, no rank made a tensor larger than its largest shard (4x smaller than
    # full)
    for r in results:
        assert (
            max(r["save_largest"], r["load_largest"])
            <= r["largest_local"]
            < r["largest_full_split"]
        ), r["ops"]
    # the stored tensors are the single-process model's, at full shape: gathered from the tp=4
    # shards
    full = _full(path)
    from seqpar.model.gpt import build_model

    expected = {
        f"model.{k}": tuple(v.shape)
        for k, v in build_model(
            build_job(sections(tmp_path)).model, device="meta"
        ).named_parameters()
    }
    assert {k: tuple(v.shape) for k, v in full.items() if k.startswith("model.")} == expected
    qkv = full["model.layers.0.attention.qkv.weight"]  # rows (kv group, [q0, q1, k, v], d)
    d = 32 // 4
    for rank, r in enumerate(results):
        group, first = divmod(rank, 2)
        base = group * 4 * d
        shard = r["local"]["layers.0.attention.qkv.weight"]["weight"]
        assert torch.equal(shard[:d], qkv[base + first * d: base + (first + 1) * d])
        assert torch.equal(shard[d:], qkv[base + 2 * d: base + 4 * d])
    word = full["model.embedding.word.weight"]
    assert word.shape[0] == 250
    assert torch.equal(
        torch.cat([r["local"]["embedding.word.weight"]["weight"] for r in results])[:250], word
    )
    # each element written once (the chunks DCP recorded add up to the full tensors, no more), in
    # one file per rank holding its quarter; beyond the fp32 values, the files hold torch.save's ~1
    # kB per chunk
    md = dcp.FileSystemReader(str(path)).read_metadata()
    stored = sum(chunk.sizes.numel() for m in md.state_dict_metadata.values() for chunk in m.chunks)
    assert stored == sum(v.numel() for v in full.values())
    model_bytes = sum(v.numel() * 4 for k, v in full.items() if k.startswith("model."))
    files = {
        n: rec["bytes"] for n, rec in ckpt.read_meta(path)["files"].items() if n.endswith(".distcp")
    }
    chunks = len(md.storage_data)
    print(
        f"tp=4 save: files {files}, total {sum(files.values())} B for {chunks} chunks; model fp32 "
        f"{model_bytes} B, Adam {2 * model_bytes} B"
    )
    assert (
        len(files) == 4 and 3 * model_bytes < sum(files.values()) < 3 * model_bytes + 2048 * chunks
    )
    # resumed at tp=2 (2 ranks): same weights and Adam state as the tp=4 ranks held
    again = run_ranks(_train_save_load, 2, str(tmp_path / "tp2"), 2, str(path))
    tp2 = _full(ckpt.resolve(again[0]["path"]))
    assert tp2.keys() == full.keys() and all(torch.equal(tp2[k], full[k]) for k in full)


def test_a_checkpoint_of_the_previous_format_loads(tmp_path):
    """``seqpar-dcp-1`` stored whole tensors: resumed from one at tp=2, the ranks hold its weights
    and Adam state (written back, they are the same tensors)."""
    from seqpar.train.loop import train_local

    new = ckpt.resolve(train_local(sections(tmp_path / "a"))["checkpoint"])  # tp=1, in this process
    old = tmp_path / "old" / "checkpoints" / "step_000002"
    old.mkdir(parents=True)
    full = _full(new)
    # whole tensors, as seqpar-dcp-1 wrote them
    dcp.save(full, checkpoint_id=str(old), no_dist=True)
    meta = json.loads((new / "meta.json").read_text())
    meta["format"] = "seqpar-dcp-1"
    # its checksums are the new files'; an old checkpoint without them loads with a note
    del meta["files"]
    (old / "meta.json").write_text(json.dumps(meta))
    (old.parent / "latest").write_text(old.name + "\n")
    resumed = run_ranks(_train_save_load, 2, str(tmp_path / "b"), 2, str(old))
    again = _full(ckpt.resolve(resumed[0]["path"]))
    assert all(torch.equal(again[k], full[k]) for k in full)


def test_an_unknown_format_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "step_000001"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"format": "seqpar-dcp-0"}))
    try:
        ckpt.read_meta(folder)
    except ckpt.CheckpointError as err:
        assert str(err) == (f"checkpoint {folder}: format 'seqpar-dcp-0' is not one seqpar reads "
                            "('seqpar-dcp-2', 'seqpar-dcp-1')")
    else:
        raise AssertionError("an unknown format loaded")
