"""End to end: examples/train_mlp.py (nn + optim + data) learns the blobs well above chance."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_mlp.py")


def _load():
    spec = importlib.util.spec_from_file_location("train_mlp_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("optimizer,lr", [("adamw", "3e-3"), ("sgd", "0.05")])
def test_train_mlp_beats_chance(optimizer, lr, capsys):
    acc = _load().main(["--samples", "2000", "--epochs", "3", "--hidden", "32", "--optimizer", optimizer,
                        "--lr", lr])
    assert acc > 0.6  # chance is 0.2 with 5 classes
    assert "validation accuracy" in capsys.readouterr().out
