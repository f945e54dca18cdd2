"""`seqpar plan` edge cases: the search skips tp values kv heads rule out,
--explain input is validated to one line (fuzzed), fp32 training is expressible (16 B/param), and
the dropout default is one value per architecture across plan, memory and paper, printed."""

import argparse
import contextlib
import io
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.analysis.formulas.shapes import (
    AnalysisError,
    OptimizerOptions,
    default_dropout,
    model_config,
)
from seqpar.analysis.formulas.states import bytes_per_parameter, stage_parameters
from seqpar.analysis.planning.planner import (
    Request,
    check_plan,
    evaluate,
    layouts,
    parse_plan,
    search,
)
from seqpar.cli import build_parser, main

KV_CASE = [
    "plan",
    "--layers",
    "4",
    "--hidden",
    "768",
    "--heads",
    "24",
    "--kv-heads",
    "3",
    "--seq",
    "512",
    "--vocab",
    "1000",
    "--arch",
    "llama",
    "--gpus",
    "8",
    "--global-batch",
    "8",
]
# the search narrowed to replicated states without offloading where the breadth of the search is not
# under test
NARROW = ["--no-fsdp", "--no-distributed-optimizer", "--no-offload"]


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exc:  # usage errors exit 2 through argparse
        code = exc.code
    return code, out.getvalue(), err.getvalue()


def _error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("seqpar plan: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------- item 12: kv heads and tp
@st.composite
def requests(draw):
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 24]))
    kv = draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0]))
    shape = model_config(layers=draw(st.sampled_from([1, 2, 3, 4, 6, 8])),
                         hidden=heads * draw(st.sampled_from([8, 16])), heads=heads,
                         seq=draw(st.sampled_from([6, 8, 12, 16])), vocab=draw(st.integers(5, 300)),
                         ffn=draw(st.sampled_from([None, 36, 48, 96])), kv_heads=kv,
                         arch=draw(st.sampled_from(["gpt", "llama"])))
    gpus = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    return Request(
        shape.validate(),
        gpus=gpus,
        global_batch=gpus * draw(st.sampled_from([1, 2, 4])),
        max_micro_batch=4,
        max_interleave=2,
    )


@settings(max_examples=60, deadline=None, derandomize=True)
@given(requests())
def test_search_only_enumerates_valid_layouts_and_never_aborts(req):
    for plan in layouts(req):
        check_plan(req, plan)  # every candidate the enumeration yields can run this model
    for ev in search(req):
        assert ev.fits and ev.error is None
        assert req.shape.num_kv_heads % ev.plan.par.tp == 0 or ev.plan.par.tp % req.shape.num_kv_heads == 0


def test_kv_heads_case_prints_plans_and_explain_of_an_invalid_tp_is_one_line():
    code, out, err = _run(KV_CASE)
    assert code == 0 and "plans fit" in out and "tp=1,pp=" in out, err
    code, out, err = _run(KV_CASE + ["--explain", "tp=2"])
    assert code == 2 and out == ""
    assert _error_line(err).endswith(
        "--explain 'tp=2': kv heads 3 and tp 2: one must divide the other"
    )
    code, out, _ = _run(KV_CASE + ["--explain", "tp=1,pp=2,mb=1"])
    assert code == 0 and "memory per pipeline rank" in out


# ---------------------------------------------------------------- item 13: --explain parsing
def test_explain_zero_and_negative_counts_are_one_line_errors():
    for text, message in (("tp=2,pp=2,mb=0", "mb must be a positive integer, got '0'"),
                          ("tp=0", "tp must be a positive integer, got '0'"),
                          ("pp=0", "pp must be a positive integer, got '0'"),
                          ("dp=-2", "dp must be a positive integer, got '-2'"),
                          ("m=0,pp=2", "m must be a positive integer, got '0'"),
                          ("keep=-1", "keep must be an integer >= 0, got '-1'"),
                          ("recompute=selective+keepx", "keep 'x' is not an integer >= 0"),
                          ("micro_batch=1.5", "micro_batch must be a positive integer, got '1.5'")):
        code, out, err = _run(["plan", "--model", "22b", "--gpus", "8", "--explain", text])
        assert code == 2 and out == "", (text, err)
        assert _error_line(err).endswith(message), (text, err)


KEYS = [
    "tp",
    "pp",
    "dp",
    "m",
    "interleave",
    "sp",
    "recompute",
    "mb",
    "micro_batch",
    "keep",
    "distopt",
    "x",
    "",
]
VALUES = st.one_of(
    st.integers(-3, 70).map(str),
    st.sampled_from(
        [
            "",
            "on",
            "off",
            "yes",
            "1.5",
            "1e3",
            "none",
            "selective",
            "full",
            "full-block-2",
            "full-uniform-0",
            "full-block-x",
            "selective+keep2",
            "full+keep-1",
            "selective+keep",
            "half",
            "9" * 30,
            " 4 ",
            "=",
            "-",
        ]
    ),
    st.text(max_size=6),
)
ITEMS = st.one_of(
    st.tuples(st.sampled_from(KEYS), VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"), st.text(max_size=8)
)
PLAN_TEXT = st.one_of(st.lists(ITEMS, max_size=6).map(",".join), st.text(max_size=30))
FUZZ_REQ = Request(
    model_config(layers=8, hidden=64, heads=8, seq=32, vocab=100, kv_heads=2, arch="llama"),
    gpus=8,
    global_batch=16,
)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(PLAN_TEXT)
def test_explain_parser_fuzz_plan_or_analysis_error(text):
    """Any --explain text parses to a plan or raises AnalysisError; a parsed plan evaluates (or says why
    it cannot run) without any other exception."""
    try:
        plan = parse_plan(text, FUZZ_REQ.gpus)
    except AnalysisError as err:
        assert "\n" not in str(err)
        return
    ev = evaluate(FUZZ_REQ, plan, every_rank=True)
    assert (ev.error is None) == bool(ev.stages)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(PLAN_TEXT)
def test_explain_cli_fuzz_exit_0_or_one_error_line(text):
    code, out, err = _run(["plan", "--layers", "8", "--hidden", "64", "--heads", "8", "--kv-heads", "2", "--seq",
                           "32", "--vocab", "100", "--arch", "llama", "--gpus", "8", "--global-batch", "16", *NARROW,
                           "--explain", text])
    if code == 2:
        _error_line(err)
    else:
        assert code == 0 and "memory per pipeline rank" in out, (text, code, err)


# ---------------------------------------------------------------- item 14: precision and dropout
def test_fp32_training_is_16_bytes_per_parameter_and_mixed_precision_18():
    # 4 weights + 4 grads + 8 Adam
    assert bytes_per_parameter(OptimizerOptions.for_precision("fp32")) == 16
    assert bytes_per_parameter(OptimizerOptions.for_precision("bf16")) == 18
    assert (
        bytes_per_parameter(OptimizerOptions.for_precision("fp32", distributed=True), dp=4)
        == 8 + 8 / 4
    )
    # states replicated over dp: the search narrowed to plans without FSDP or the distributed
    # optimizer
    args = [
        "plan",
        "--model",
        "gpt2-medium",
        "--gpus",
        "8",
        "--global-batch",
        "8",
        *NARROW,
        "--json",
    ]
    for dtype, per_param, act in (("fp32", 16, 4), ("bf16", 18, 2)):
        code, out, _ = _run(args + ["--dtype", dtype])
        data = json.loads(out)
        assert code == 0 and data["settings"]["bytes_per_parameter"] == per_param
        assert data["settings"]["activation_bytes"] == act
        best = data["best"]
        states = sum(
            best["memory_terms"][k] for k in ("parameters", "gradients", "optimizer_states")
        )
        from seqpar.analysis.formulas.presets import preset_shape
        from seqpar.config import ParallelConfig

        par = ParallelConfig(
            tp=best["tp"],
            pp=best["pp"],
            dp=best["dp"],
            sp=best["sp"],
            interleave=best["interleave"],
        )
        assert states == per_param * stage_parameters(
            preset_shape("gpt2-medium"), par, best["most_loaded_rank"]
        )
    code, out, _ = _run(args[:-1] + ["--dtype", "fp32"])
    assert "fp32 throughout: 16 B/param model states, 4-byte activations" in out


def _parsed(argv):
    parsed = build_parser().parse_args(argv)
    assert isinstance(parsed, argparse.Namespace)
    return parsed


def test_dropout_default_is_one_value_per_architecture_everywhere():
    from seqpar.analysis.reports.paper import beyond_the_paper
    from seqpar.commands.memory import model_from_args
    from seqpar.commands.plan import request_from_args

    for arch, preset in (("gpt", "gpt2-medium"), ("llama", "llama2-7b")):
        p = default_dropout(arch)
        memory = _parsed(["memory", "--arch", arch])
        memory.layers = 1
        cfg = model_from_args(memory)
        assert cfg.hidden_dropout == cfg.embd_dropout == p
        req = request_from_args(
            _parsed(["plan", "--model", preset, "--gpus", "8", "--global-batch", "8"])
        )
        assert req.opts.dropout == (p > 0) and req.dropout == p
        code, out, _ = _run(
            ["plan", "--model", preset, "--gpus", "8", "--global-batch", "8", *NARROW, "--json"]
        )
        assert json.loads(out)["settings"]["dropout"] == p
        assert ("embedding_dropout_mask" in json.loads(out)["best"]["memory_terms"]) == (p > 0)
    assert default_dropout("llama") == 0.0 and default_dropout("gpt") == 0.1
    # the paper's Llama table is computed without masks, as the default says
    table = beyond_the_paper()
    from seqpar.analysis.formulas.memory import layer_activation_bytes
    from seqpar.analysis.formulas.presets import preset_shape

    sh = preset_shape("llama2-7b")
    kw = dict(
        ffn=sh.ffn, dropout=False, kv_heads=sh.kv_heads, norm=sh.norm, activation=sh.activation
    )
    tp_only = layer_activation_bytes(sh.seq_len, 1, sh.hidden_size, sh.num_heads, 8, **kw)
    tp_sp = layer_activation_bytes(sh.seq_len, 1, sh.hidden_size, sh.num_heads, 8, sp=True, **kw)
    assert table["llama2-7b materialized"]["tp_sp"] == 100 * tp_sp / tp_only
    code, out, _ = _run(["plan", "--model", "llama2-7b", "--gpus", "8", "--global-batch", "8"])
    assert "dropout 0 (no masks)" in out.splitlines()[1]
    code, out, _ = _run(
        ["plan", "--model", "llama2-7b", "--gpus", "8", "--global-batch", "8", "--dropout", "0.1"]
    )
    assert "dropout 0.1;" in out.splitlines()[1]
