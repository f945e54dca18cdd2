"""What a checkpoint load checks (docs/training.md, checkpoints): a resumed run's model equals the
checkpoint's; the model tensors fit the config meta.json records, on every load; every file matches
the SHA-256 recorded at save (bit flips, truncation); `seqpar verify`; a folder that is not a
checkpoint (a Hugging Face folder above all) is named as such."""

import dataclasses
import json
import re
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import seqpar.config as config_module
from seqpar.cli import main
from seqpar.config import ModelConfig, RunConfig
from seqpar.model.gpt import build_model
from seqpar.train import checkpoint as ckpt
from seqpar.train.config import JobConfig

TRAIN = [
    "--steps",
    "3",
    "--micro-batch",
    "2",
    "--global-batch",
    "4",
    "--no-progress",
    "--set",
    "train.eval_batches=1",
    "--set",
    "train.plot=false",
    "--set",
    "train.peak_tflops=1.0",
]
GPT = ModelConfig(vocab_size=256, hidden_size=32, num_heads=4, num_layers=2, seq_len=16)
LLAMA = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_heads=4,
    num_layers=2,
    seq_len=16,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    kv_heads=2,
    bias=False,
    tie_embeddings=False,
    embd_dropout=0.0,
    attn_dropout=0.0,
    hidden_dropout=0.0,
)


def write_checkpoint(root, cfg: ModelConfig, seed: int = 0):
    """A step-0 checkpoint of ``cfg``'s freshly initialised weights (as import-hf writes one)."""
    model = build_model(cfg, seed=seed)
    meta = {
        "step": 0,
        "skipped": 0,
        "has_optimizer": False,
        "config": JobConfig(RunConfig(model=cfg)).to_dict(),
    }
    return ckpt.save(
        root, 0, {f"model.{k}": v.detach().float() for k, v in model.named_parameters()}, meta
    )


@pytest.fixture(scope="module")
def gpt_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gpt"), GPT)


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llama"), LLAMA)


def _copy(path, tmp_path):
    return shutil.copytree(path, tmp_path / path.name)


def _run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exit_info:
        code = exit_info.code
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------- 20.3: the model on resume
def _alternatives(cfg: ModelConfig, name: str):
    """Other values of field ``name`` (the config is validated by the caller)."""
    value = getattr(cfg, name)
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, float):
        return [x for x in (value * 2, value + 1.0, value / 2, 0.1) if x != value]
    if isinstance(value, int) or value is None:
        base = getattr(cfg, {"kv_heads": "num_kv_heads", "ffn_hidden_size": "ffn"}.get(name, name))
        return [
            x
            for x in ((base * 2, base // 2, base + 1) if base is not None else (8, 64, 1024))
            if x != value
        ]
    options = [
        t for t in vars(config_module).values() if isinstance(t, tuple | dict) and value in t
    ]
    return [o for t in options for o in t if o != value]


def _changed(cfg: ModelConfig, name: str) -> ModelConfig | None:
    for other in _alternatives(cfg, name):
        try:
            return dataclasses.replace(cfg, **{name: other}).validate()
        except (config_module.ConfigError, TypeError, ZeroDivisionError):
            continue
    return None


FIELDS = [f.name for f in dataclasses.fields(ModelConfig)]
MUST_MATCH = [n for n in FIELDS if n not in ckpt.RESUME_MAY_CHANGE]


@pytest.mark.parametrize("name", MUST_MATCH)
def test_resume_refuses_any_change_of_the_model(gpt_ckpt, llama_ckpt, name):
    """Every model field but the layout-like ones, each changed alone on a GPT and a Llama
    checkpoint (values generated from the field's type and the config's option lists)."""
    tried = 0
    for path, cfg in ((gpt_ckpt, GPT), (llama_ckpt, LLAMA)):
        changed = _changed(cfg, name)
        if changed is None:
            continue
        tried += 1
        with pytest.raises(
            ckpt.CheckpointError,
            match=rf"a different model \({name} .* in the checkpoint, .* in "
            "this run",
        ):
            ckpt.check_resume(path, changed)
    core = {
        "vocab_size",
        "hidden_size",
        "num_heads",
        "num_layers",
        "ffn_hidden_size",
        "norm",
        "activation",
        "position",
        "kv_heads",
        "bias",
        "tie_embeddings",
        "rope_theta",
        "layernorm_eps",
    }
    assert tried or name not in core, f"no valid change of {name} was generated"


@pytest.mark.parametrize("name", sorted(ckpt.RESUME_MAY_CHANGE))
def test_resume_accepts_layout_like_model_changes(llama_ckpt, tmp_path, name):
    """Each field a resume may change, changed alone on the Llama checkpoint, or on an MoE one for
    the MoE training settings (a dense model has no capacity to change)."""
    cfg, path = LLAMA, llama_ckpt
    changed = _changed(cfg, name)
    if changed is None:
        cfg = dataclasses.replace(LLAMA, experts=4, top_k=2).validate()
        path, changed = write_checkpoint(tmp_path, cfg), _changed(cfg, name)
    assert changed is not None, f"no valid change of {name} alone"
    assert ckpt.check_resume(path, changed) == path
    assert ckpt.check_resume(path, cfg) == path


@pytest.mark.parametrize(
    "flags, change",
    [
        (["--heads", "8"], "num_heads 4 in the checkpoint, 8 in this run"),
        (["--layers", "1"], "num_layers 2 in the checkpoint, 1 in this run"),
        (
            ["--set", "model.activation=gelu_tanh"],
            "activation gelu in the checkpoint, gelu_tanh in this run",
        ),
    ],
)
@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]])
def test_resume_with_a_different_model_is_one_line_exit_2(
    gpt_ckpt, tmp_path, capsys, flags, change, nproc
):
    """A user's case (--heads 8 on a 4-head checkpoint), in-process and before --nproc starts
    ranks."""
    code, out, err = _run(
        capsys,
        "train",
        "--resume",
        str(gpt_ckpt),
        "--out",
        str(tmp_path / "run"),
        *TRAIN,
        *flags,
        *nproc,
    )
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("seqpar train: error: cannot resume from"), err
    assert change in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_resume_with_layout_and_training_changes_still_runs(gpt_ckpt, tmp_path, capsys):
    code, out, err = _run(
        capsys,
        "train",
        "--resume",
        str(gpt_ckpt),
        "--out",
        str(tmp_path / "run"),
        *TRAIN,
        "--lr",
        "1e-3",
        "--recompute",
        "selective",
        "--set",
        "model.hidden_dropout=0.0",
    )
    assert code == 0, err
    assert f"resumed from {gpt_ckpt}" in out


# -------------------------------------------------------- 20.3: tensors against the recorded config
def _edit_meta(folder, keep_checksum=False, **model):
    meta = json.loads((folder / "meta.json").read_text())
    meta["config"]["model"].update(model)
    if not keep_checksum:
        # as if whoever edited it recomputed nothing: the tensors must speak
        del meta["model_sha256"]
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            {"num_heads": 8, "keep_checksum": True},
            r"the \[model\] config in meta.json was edited after the save",
        ),
        (
            {"hidden_size": 64},
            r"model.embedding.position has shape \(16, 32\), that model's is \(16, 64\)",
        ),
        ({"num_layers": 1}, r"model.layers.1.attention.out_proj.bias has no place in that model"),
        ({"num_layers": 3}, r"model.layers.2.attention.out_proj.bias is missing"),
        (
            {"bias": False},
            r"model.layers.0.attention.out_proj.bias has no place in that model \(and 7 more",
        ),
        (
            {"vocab_size": 300},
            r"model.embedding.word.weight has shape \(256, 32\), that model's is \(300, 32\)",
        ),
        ({"tie_embeddings": False}, r"model.output_weight is missing"),
    ],
)
@pytest.mark.parametrize("verb", ["sample", "export-hf", "train"])
def test_every_load_checks_the_tensors_against_the_recorded_config(
    gpt_ckpt, tmp_path, capsys, edit, message, verb
):
    folder = _copy(gpt_ckpt, tmp_path)
    _edit_meta(folder, **edit)
    argv = {
        "sample": ["sample", "--checkpoint", str(folder), "--tokens", "2"],
        "export-hf": ["export-hf", str(folder), "--out", str(tmp_path / "hf")],
        "train": ["train", "--resume", str(folder), "--out", str(tmp_path / "run"), *TRAIN],
    }[verb]
    code, out, err = _run(capsys, *argv)
    assert code == 2 and re.search(message, err), err
    assert "Traceback" not in err and not (tmp_path / "hf").exists()
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.load_model_state(folder)


# ---------------------------------------------------------------- 20.4: checksums, verify
def test_save_records_a_checksum_per_file(gpt_ckpt):
    import hashlib

    meta = json.loads((gpt_ckpt / "meta.json").read_text())
    names = sorted(p.name for p in gpt_ckpt.iterdir() if p.name != "meta.json")
    assert sorted(meta["files"]) == names and ".metadata" in names
    for name in names:
        data = (gpt_ckpt / name).read_bytes()
        assert meta["files"][name] == {
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, 10**6), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_bit_flip_is_found_at_load_and_by_verify(gpt_ckpt, tmp_path_factory, capsys, which, where, bit):
    folder = _copy(gpt_ckpt, tmp_path_factory.mktemp("flip"))
    files = sorted(p for p in folder.iterdir() if p.name != "meta.json")
    target = files[which % len(files)]
    data = bytearray(target.read_bytes())
    data[int(where * len(data))] ^= 1 << bit
    target.write_bytes(data)
    with pytest.raises(ckpt.CheckpointError, match=rf"is damaged: {target.name} does not match the SHA-256"):
        ckpt.load_model_state(folder)
    code, out, err = _run(capsys, "verify", str(folder))
    assert code == 2 and err == f"seqpar verify: {folder}: {target.name} does not match the SHA-256 recorded at " \
                                "save: its bytes changed (a bit flip?)\n"


def test_verify_lists_each_problem_and_passes_a_good_checkpoint(gpt_ckpt, tmp_path, capsys):
    # a folder with `latest` works too
    code, out, err = _run(capsys, "verify", str(gpt_ckpt.parent))
    assert code == 0 and err == "" and out.startswith(f"{gpt_ckpt}: ok -- step 0; 2 files")
    folder = _copy(gpt_ckpt, tmp_path)
    (folder / "__0_0.distcp").write_bytes(b"")
    (folder / ".metadata").write_bytes((folder / ".metadata").read_bytes()[:-1] + b"!")
    code, out, err = _run(capsys, "verify", str(folder))
    assert code == 2 and err.splitlines() == [
        f"seqpar verify: {folder}: .metadata does not match the SHA-256 recorded at save: its "
        f"bytes changed (a bit "
        "flip?)",
        f"seqpar verify: {folder}: __0_0.distcp has 0 bytes, the save wrote "
        f"{(gpt_ckpt / '__0_0.distcp').stat().st_size} (truncated or replaced?)",
    ]


def test_a_checkpoint_without_checksums_loads_with_a_note(gpt_ckpt, tmp_path, capsys):
    folder = _copy(gpt_ckpt, tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    del meta["files"], meta["model_sha256"]
    (folder / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    state, _ = ckpt.load_model_state(folder)
    assert "records no checksums" in capsys.readouterr().err and "embedding.word.weight" in state
    code, out, err = _run(capsys, "verify", str(folder))
    assert (
        code == 0
        and out.startswith(f"note: {folder} records no checksums")
        and f"{folder}: ok" in out
    )


def _save_flip_check(rank, world, root):
    """On every rank: save a checkpoint, check it, rank 0 flips a bit in the file rank 1 hashes,
    check again."""
    import torch.distributed as dist

    path = write_checkpoint(root, GPT)
    clean = ckpt.file_problems(path, ckpt.read_meta(path), collective=True)
    names = sorted(ckpt.read_meta(path)["files"])
    victim = path / names[1]  # hashed by rank 1 (the items are dealt round-robin)
    if rank == 0:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(data)
    dist.barrier()
    try:
        ckpt.check_before_load(path, ckpt.read_meta(path), collective=True)
        error = ""
    except ckpt.CheckpointError as err:
        error = str(err)
    return clean, victim.name, error


def test_two_ranks_split_the_hashing_at_save_and_load(tmp_path):
    """A flip in the file rank 1 hashes is reported, naming it, on both ranks."""
    from seqpar.parallel.launch import run_ranks

    results = run_ranks(_save_flip_check, 2, str(tmp_path))
    assert results[0][0] == results[1][0] == []
    victim = results[0][1]
    assert victim.endswith(".distcp")
    for _, _, error in results:
        assert f"is damaged: {victim} does not match the SHA-256 recorded at save" in error


# ---------------------------------------------------------- 16.10: folders that are not checkpoints
def test_a_hugging_face_folder_is_named_and_import_hf_suggested(tmp_path, capsys):
    hf = tmp_path / "gpt2-hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (hf / "model.safetensors").write_bytes(b"{}")
    expected = (f"{hf} is a Hugging Face model folder, not a seqpar checkpoint; convert it with "
                f"`seqpar import-hf {hf} --out CKPT` and use CKPT")
    for argv in (
        ["sample", "--checkpoint", str(hf)],
        ["export-hf", str(hf), "--out", str(tmp_path / "x")],
        ["train", "--resume", str(hf), "--out", str(tmp_path / "run"), *TRAIN],
        ["verify", str(hf)],
    ):
        code, out, err = _run(capsys, *argv)
        assert code == 2 and expected in err and "interrupted" not in err, (argv, err)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda p: (p / "notes.txt").write_text("hi"),
            r"is not a seqpar checkpoint \(no meta.json, no `latest`\)",
        ),
        (
            lambda p: (p / "step_000002").mkdir(),
            r"holds no complete checkpoint \(no `latest` file names one\)",
        ),
        (
            lambda p: (p / "__0_0.distcp").write_bytes(b"x"),
            r"is incomplete: meta.json is missing \(an interrupted save",
        ),
    ],
)
def test_other_folders_say_what_they_are(tmp_path, make, message):
    make(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.resolve(tmp_path)


def test_resumed_weights_are_the_checkpoints(gpt_ckpt):
    """The checks do not change what loads: the state is the saved model's, bit for bit."""
    state, _ = ckpt.load_model_state(gpt_ckpt)
    model = build_model(GPT, seed=0)
    assert all(torch.equal(state[k], v.detach()) for k, v in model.named_parameters())
