"""Bad flags are refused (issue 39 item 7): negative or zero counts, in one line naming the flag."""
import os
import subprocess
import sys

import pytest

from axonmpi.testing import mpiexec_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "train_gpt.py")


def _gpt(*args):
    return subprocess.run([sys.executable, GPT, *args], capture_output=True, text=True, timeout=120, env=mpiexec_env())


def _trainer():
    """examples/train_gpt.py as a module (its ``parse_args`` checks every flag before anything starts)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_gpt_flags", GPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.serial
def test_train_gpt_refuses_a_bad_count_as_a_command_in_one_line():
    """As a command: exit 2, one line on stderr (the in-process test below checks each flag's message)."""
    r = _gpt("--save-every", "-1")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["train_gpt.py: error: --save-every must be >= 0 (0: only at the end), "
                                             "got -1"], r.stderr


@pytest.mark.serial
@pytest.mark.parametrize("flag,value,says", [
    ("--save-every", "-1", "--save-every must be >= 0 (0: only at the end), got -1"),      # on main: saved every step
    ("--eval-batches", "-1", "--eval-batches must be >= 0 (0: no final evaluation), got -1"),   # on main: a nan loss
    ("--grad-clip", "-1", "--grad-clip must be >= 0 (0: no clipping), got -1.0"),          # on main: clipping off
    ("--steps", "0", "--steps must be a whole number >= 1, got 0"),
    ("--microbatches", "-2", "--microbatches must be a whole number >= 1, got -2"),
    ("--warmup", "-5", "--warmup must be >= 0 (0: none), got -5"),
    ("--lr", "0", "--lr must be > 0, got 0.0"),
    ("--dropout", "1.5", "--dropout must be a probability in [0, 1), got 1.5"),
    ("--G-data", "0", "--G-data must be a whole number >= 1, got 0"),
    ("--corpus-bytes", "-1", "--corpus-bytes must be a whole number >= 1, got -1"),
])
def test_train_gpt_refuses_a_count_that_makes_no_sense_in_one_line(flag, value, says, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [GPT])
    with pytest.raises(SystemExit) as e:
        _trainer().parse_args([flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"train_gpt.py: error: {says}"], err


@pytest.mark.serial
@pytest.mark.parametrize("args,says", [
    (["plan", "--world", "4", "--layers", "2", "--width", "64", "--seq", "8", "--global-batch", "8", "--tflops", "-1"],
     "argument --tflops: expected a number > 0, got -1"),
    (["plan", "--world", "4", "--layers", "2", "--width", "64", "--seq", "8", "--global-batch", "8", "--moe-experts",
      "-4"], "argument --moe-experts: expected a whole number >= 0, got -4"),
    (["plan", "--world", "0", "--layers", "2", "--width", "64", "--seq", "8", "--global-batch", "8"],
     "argument --world: expected a whole number >= 1, got 0"),
    (["ckpt", "export", "a", "b", "--n-head", "0"], "argument --n-head: expected a whole number >= 1, got 0"),
    (["ckpt", "export", "a", "b", "--max-shard-size=-5GB"], "argument --max-shard-size: max_shard_size '-5GB'"),
    (["ckpt", "export", "a", "b", "--max-shard-size", "0"], "argument --max-shard-size: max_shard_size '0' must be"),
])
def test_the_cli_refuses_a_count_that_makes_no_sense_naming_the_flag(args, says, capsys):
    """In process (``axonmpi.cli.main``: what ``python -m axonmpi`` runs; test_examples_cli runs it as a command)."""
    from axonmpi.cli import main
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code in (1, 2), err
    assert says in err and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1, err
