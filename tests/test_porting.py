"""docs/porting.md: its loop runs under PyTorch with PyTorch's imports, as it runs here with ours."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "porting.md")

OURS = ["import axonmpi as torch", "from axonmpi import nn", "from axonmpi.optim.lr_scheduler import OneCycleLR",
        "from axonmpi.data import DataLoader, TensorDataset"]
THEIRS = ["import torch", "from torch import nn", "from torch.optim.lr_scheduler import OneCycleLR",
          "from torch.utils.data import DataLoader, TensorDataset"]


def _loop():
    text = open(DOC).read()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def _run(code, python=sys.executable):
    from axonmpi.testing import mpiexec_env      # without the launcher's PMI_* variables (the suite runs under mpiexec)
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300,
                       env=mpiexec_env({"OMP_NUM_THREADS": "1"}))
    assert r.returncode == 0, r.stderr
    return [float(a) for a in re.findall(r"test accuracy ([0-9.]+)", r.stdout)]


def test_the_only_differences_are_the_imports():
    code = _loop()
    assert all(line in code.splitlines() for line in OURS)
    diff = re.search(r"```diff\n(.*?)```", open(DOC).read(), re.S).group(1).splitlines()
    assert [ln[1:] for ln in diff if ln.startswith("+")] == OURS
    assert [ln[1:] for ln in diff if ln.startswith("-")] == THEIRS


@pytest.mark.serial
def test_loop_reaches_the_same_accuracy_under_torch():
    pytest.importorskip("torch")
    code = _loop()
    for ours, theirs in zip(OURS, THEIRS):
        code = code.replace(ours + "\n", theirs + "\n")
    assert "axonmpi" not in code
    mine, torchs = _run(_loop()), _run(code)
    assert len(mine) == len(torchs) == 4 and mine[-1] == torchs[-1] >= 0.9
