"""seqpar runs from a checkout with torch alone (``PYTHONPATH=. python3 -m seqpar ...``, as on a
lent GPU machine where nothing can be installed): every optional package blocked, the verbs that
need none run and exit 0 without a traceback, and a feature that needs one is refused in one line
naming the extra to install."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from seqpar.optional import EXTRAS, install_hint

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = sorted({*EXTRAS, "numpy", "hypothesis", "tqdm", "pytest"})
# a sitecustomize on PYTHONPATH: the path finder no longer finds an optional package, as if it were
# not installed (find_spec gives None, import raises ModuleNotFoundError)
BLOCKER = f"""import importlib.machinery
BLOCKED = {BLOCKED!r}
_find = importlib.machinery.PathFinder.find_spec
def _find_spec(name, path=None, target=None):
    return None if name.split(".")[0] in BLOCKED else _find(name, path, target)
importlib.machinery.PathFinder.find_spec = staticmethod(_find_spec)
"""


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """``run(*argv) -> (rc, stdout, stderr)``: ``python -m seqpar ARGV`` from the checkout, extras
    blocked, in a scratch working directory."""
    scratch = tmp_path_factory.mktemp("bare")
    (scratch / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": f"{scratch}{os.pathsep}{ROOT}", "PYTHONWARNINGS": "ignore"}
    env.pop("SEQPAR_TIMEOUT", None)

    def run(*argv):
        p = subprocess.run(
            [sys.executable, "-m", "seqpar", *argv],
            capture_output=True,
            text=True,
            env=env,
            cwd=scratch,
            timeout=300,
        )
        return p.returncode, p.stdout, p.stderr

    run.scratch, run.env = scratch, env
    return run


def test_the_blocker_blocks(bare):
    p = subprocess.run(
        [sys.executable, "-c", "import rich"], capture_output=True, text=True, env=bare.env
    )
    assert p.returncode != 0 and "No module named 'rich'" in p.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        ["plan", "--gpus", "8", "--model", "22B", "--top", "1"],
        ["paper"],
        ["selftest", "--device", "cpu", "--nproc", "1", "--quick", "--only", "training"],
    ],
)
def test_verbs_run_with_torch_alone(bare, argv):
    rc, out, err = bare(*argv)
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    assert out.strip()


def test_train_two_steps_with_torch_alone(bare):
    out_dir = bare.scratch / "run"
    rc, out, err = bare("train", "--config", str(ROOT / "configs" / "tiny.toml"), "--steps", "2",
                        "--set", f"train.out_dir={out_dir}", "--overwrite")
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    # no matplotlib: no plot
    assert (out_dir / "metrics.jsonl").is_file() and not (out_dir / "loss.png").exists()
    assert "pip install tensorboard" in out or "pip install 'seqpar[tensorboard]'" in out


@pytest.mark.parametrize(
    "argv, extra",
    [
        (["paper", "--plot", "{scratch}/plots"], "plots"),
        (
            [
                "tokenizer",
                "train",
                "--vocab",
                "300",
                "--out",
                "{scratch}/tok.json",
                "{scratch}/corpus.txt",
            ],
            "tokenizers",
        ),
    ],
)
def test_a_feature_needing_a_missing_package_is_one_line(bare, argv, extra):
    (bare.scratch / "corpus.txt").write_text("hello world\n")
    rc, out, err = bare(*[a.format(scratch=bare.scratch) for a in argv])
    assert rc == 2 and "Traceback" not in err and out == "", err
    assert err.splitlines()[0].endswith(f"pip install 'seqpar[{extra}]'"), err


def test_install_hint_names_the_extra():
    assert install_hint("matplotlib") == "pip install 'seqpar[plots]'"
    assert install_hint("numpy") == "pip install numpy"
