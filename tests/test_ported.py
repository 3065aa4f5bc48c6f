"""Two scripts ported by their imports alone (tests/ported/): PyTorch's DDP tutorial and the AxoNN user
guide's steps. Each runs here at 1, 2 and 4 ranks; where torch is installed the same file with PyTorch's
(and AxoNN's) imports runs under torch and prints the same losses (float32: 1e-5 relative)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from axonmpi.testing import mpiexec_env, run_mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORTED = os.path.join(ROOT, "tests", "ported")
BEGIN, END = "# --- IMPORTS (PyTorch", "# --- IMPORTS end ---"

TORCH_IMPORTS = {
    "ddp_tutorial.py": ["import torch", "import torch.distributed as dist", "import torch.nn as nn",
                        "import torch.optim as optim",
                        "from torch.nn.parallel import DistributedDataParallel as DDP"],
    "axonn_guide.py": ["import torch", "import torch.nn as nn", "import torch.distributed as dist",
                       "from axonn import axonn as ax", "from axonn.intra_layer import auto_parallelize, sync_gradients",
                       "from torch.utils.data import TensorDataset"],
}
OUR_IMPORTS = {
    "ddp_tutorial.py": ["import axonmpi as torch", "import axonmpi.distributed as dist", "import axonmpi.nn as nn",
                        "import axonmpi.optim as optim",
                        "from axonmpi.parallel import DistributedDataParallel as DDP"],
    "axonn_guide.py": ["import axonmpi as torch", "import axonmpi.nn as nn", "import axonmpi.distributed as dist",
                       "import axonmpi as ax", "from axonmpi.intra_layer import auto_parallelize, sync_gradients",
                       "from axonmpi.data import TensorDataset"],
}
AXONN_GRIDS = {1: "1,1,1,1", 2: "1,1,1,2", 4: "2,1,2,1"}     # G_data, G_intra_r, G_intra_c, G_intra_d


def _source(name):
    with open(os.path.join(PORTED, name), encoding="utf-8") as f:
        return f.read()


def _import_block(text):
    a, b = text.index(BEGIN), text.index(END)
    return [ln for ln in text[a:b].splitlines()[1:] if ln.strip()]


def _torch_version(name, tmp_path):
    text = _source(name)
    a, b = text.index(BEGIN), text.index(END)
    out = text[:a] + "\n".join(TORCH_IMPORTS[name]) + "\n" + text[b:]
    path = tmp_path / name.replace(".py", "_torch.py")
    path.write_text(out, encoding="utf-8")
    return str(path), out


@pytest.mark.parametrize("name", sorted(TORCH_IMPORTS))
def test_only_the_imports_differ(name, tmp_path):
    assert _import_block(_source(name)) == OUR_IMPORTS[name]
    _, theirs = _torch_version(name, tmp_path)
    assert "axonmpi" not in theirs.replace("axonmpi's", "").split(END)[1], "axonmpi named outside the imports"


def _losses(stdout, pattern):
    got = {}
    for m in re.finditer(pattern, stdout):
        *key, loss = m.groups()
        got[tuple(key)] = float(loss)
    return got


def _check(r, what):
    assert r.returncode == 0, f"{what} failed (exit {r.returncode})\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"


def _torchrun(script, n, args=(), env=None, cwd=None):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found beside torch")
    r = subprocess.run([torchrun, "--standalone", f"--nproc_per_node={n}", script, *args], capture_output=True,
                       text=True, timeout=600, env=mpiexec_env(env), cwd=cwd)
    _check(r, f"torchrun {script} at {n} process(es)")
    return r.stdout


DDP_LINE = r"(basic|before|after) rank (\d+) step (\d+) loss [0-9.]+ mean ([0-9.]+)"
DDP_LOCAL = r"(basic|before|after) rank (\d+) step (\d+) loss ([0-9.]+)"


@pytest.mark.serial
@pytest.mark.parametrize("n", [1, 2, 4])
def test_ddp_tutorial(n, tmp_path):
    r = run_mpiexec([os.path.join(PORTED, "ddp_tutorial.py"), str(tmp_path)], n=n, timeout=600, cwd=str(tmp_path))
    _check(r, f"ddp_tutorial.py at {n} rank(s)")
    ours, local = _losses(r.stdout, DDP_LINE), _losses(r.stdout, DDP_LOCAL)
    assert len(ours) == 2 * 2 * 4 * n or len(ours) == 3 * 4 * n, sorted(ours)
    for (tag, rank, step), mean in ours.items():      # the all_reduce in place: every rank the same mean
        assert mean == pytest.approx(sum(local[(tag, str(k), step)] for k in range(n)) / n, rel=2e-6)
    assert not os.path.exists(tmp_path / "model.checkpoint"), "rank 0 removes the checkpoint"
    pytest.importorskip("torch")
    script, _ = _torch_version("ddp_tutorial.py", tmp_path)
    theirs = _losses(_torchrun(script, n, [str(tmp_path)], cwd=str(tmp_path)), DDP_LOCAL)
    assert set(theirs) == set(local)
    bad = {k: (local[k], theirs[k]) for k in local if abs(local[k] - theirs[k]) > 1e-5 * max(1.0, abs(theirs[k]))}
    assert not bad, f"axonmpi vs torch losses differ at {n} rank(s): {bad}"


_TORCH_AXONN = {}


def _axonn_under_torch(tmp_path):
    if "losses" not in _TORCH_AXONN:
        script, _ = _torch_version("axonn_guide.py", tmp_path)
        env = {"PYTHONPATH": os.pathsep.join([os.path.join(PORTED, "torch_axonn"), ROOT])}
        _TORCH_AXONN["losses"] = _losses(_torchrun(script, 1, env=env, cwd=str(tmp_path)), AXONN_LINE)
    return _TORCH_AXONN["losses"]


AXONN_LINE = r"epoch (\d+) step (\d+) loss ([0-9.]+)"


@pytest.mark.serial
@pytest.mark.parametrize("n", [1, 2, 4])
def test_axonn_guide(n, tmp_path):
    r = run_mpiexec([os.path.join(PORTED, "axonn_guide.py")], n=n, timeout=600, cwd=str(tmp_path),
                    env={"AXONN_GRID": AXONN_GRIDS[n]})
    _check(r, f"axonn_guide.py at {n} rank(s), grid {AXONN_GRIDS[n]}")
    ours = _losses(r.stdout, AXONN_LINE)
    assert len(ours) == 2 * 256 // 32, sorted(ours)
    assert ours[("1", "7")] < 0.5 * ours[("0", "0")], "training did not lower the loss"
    pytest.importorskip("torch")
    theirs = _axonn_under_torch(tmp_path)
    assert set(theirs) == set(ours)
    bad = {k: (ours[k], theirs[k]) for k in ours if abs(ours[k] - theirs[k]) > 1e-5 * max(1.0, abs(theirs[k]))}
    assert not bad, f"axonmpi at {n} rank(s) (grid {AXONN_GRIDS[n]}) vs the one-process torch run: {bad}"
