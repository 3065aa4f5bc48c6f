"""PyTorch's tutorials ported by their imports alone (tests/ported/), and the AxoNN user guide's steps.

Each tutorial file holds PyTorch's published code with its import lines written by the rule of
docs/porting.md (`torch` becomes `axonmpi` in every import line); what else differs (the data source, a
printed checksum, the world size read from the environment) is listed in the file's docstring and is the
same in both versions. Each runs here under axonmpi at 1, 2 and 4 ranks; where torch is installed, the
same file with the rule undone runs under torch at 2 processes (CPU-only torch gets
tests/ported/torch_cpu/sitecustomize.py, which answers the GPU calls as axonmpi does on a CPU host) and the
two are compared: on the values both must print (closed-form collectives, the same model on every rank),
and on the tutorial's own printed checks (losses falling, test-set counts) where the frameworks' random
streams differ.
"""
import os
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from axonmpi.testing import mpiexec_env, run_mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORTED = os.path.join(ROOT, "tests", "ported")
SHIM = os.path.join(PORTED, "torch_cpu")
BEGIN, END = "# --- IMPORTS (PyTorch", "# --- IMPORTS end ---"
TUTORIALS = ["ddp_tutorial.py", "fsdp_tutorial.py", "dist_tuto.py", "tp_example.py"]
# every tutorial at 2 and 4 ranks in make test; the 1-rank runs (each a 2- and 4-rank case's degenerate form)
# only in make test-all
RANKS = [pytest.param(1, marks=pytest.mark.slow), 2, 4]
# one write per process at exit: the ranks' lines do not interleave mid-line
QUIET = {"PYTHONUNBUFFERED": "", "OMP_NUM_THREADS": "1"}


def _source(name):
    with open(os.path.join(PORTED, name), encoding="utf-8") as f:
        return f.read()


def _import_lines(text):
    a, b = text.index(BEGIN), text.index(END)
    return [ln for ln in text[a:b].splitlines()[1:] if ln.strip()]


def undo_rule(line):
    """The import rule backwards: `axonmpi` becomes `torch` (`import axonmpi as torch` is `import torch`)."""
    if line.strip() == "import axonmpi as torch":
        return "import torch"
    return line.replace("axonmpi", "torch")


def _torch_version(name, tmp_path):
    text = _source(name)
    a, b = text.index(BEGIN), text.index(END)
    head, block, tail = text[:a], text[a:b], text[b:]
    block = "\n".join(undo_rule(ln) if ln.startswith(("import ", "from ")) else ln for ln in block.splitlines())
    path = tmp_path / name.replace(".py", "_torch.py")
    path.write_text(head + block + "\n" + tail, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("name", TUTORIALS)
def test_only_the_imports_differ_and_by_the_rule(name, tmp_path):
    text = _source(name)
    lines = _import_lines(text)
    assert lines and all("axonmpi" in ln for ln in lines if ln.startswith(("import ", "from ")))
    for ln in lines:
        if ln.startswith(("import ", "from ")):
            assert undo_rule(ln).count("torch") >= 1 and "axonmpi" not in undo_rule(ln), ln
    body = text[text.index(END):]
    assert "axonmpi" not in body, f"{name}: axonmpi named outside the import block"
    theirs = open(_torch_version(name, tmp_path), encoding="utf-8").read()
    assert "axonmpi" not in theirs[theirs.index(BEGIN):], "the torch version still names axonmpi"
    compile(theirs, name, "exec")


def _check(r, what):
    assert r.returncode == 0, f"{what} failed (exit {r.returncode})\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    return r.stdout


def _ours(name, n, tmp_path, args=(), env=None):
    e = dict(QUIET, WORLD_SIZE=str(n), **(env or {}))
    r = run_mpiexec([os.path.join(PORTED, name), *args], n=n, timeout=600, cwd=str(tmp_path), env=e)
    return _check(r, f"{name} at {n} rank(s)")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


_THEIRS = {}


def _theirs(name, tmp_path_factory, args=(), n=2, torchrun=False):
    """The torch version's stdout at n processes (run once per session)."""
    if name in _THEIRS:
        return _THEIRS[name]
    pytest.importorskip("torch")
    d = tmp_path_factory.mktemp(name.replace(".py", "_torch"))
    script = _torch_version(name, d)
    env = mpiexec_env(dict(QUIET, WORLD_SIZE=str(n), MASTER_PORT=_free_port(), CKPT_DIR=str(d),
                           PYTHONPATH=os.pathsep.join([SHIM, ROOT])))
    if torchrun:
        exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
        if exe is None:
            pytest.skip("torchrun not found beside torch")
        env.pop("WORLD_SIZE")
        cmd = [exe, "--standalone", f"--nproc_per_node={n}", script, *args]
    else:
        cmd = [sys.executable, script, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=str(d), start_new_session=True)
    _THEIRS[name] = _check(r, f"{name} under torch at {n} processes")
    return _THEIRS[name]


def _rel(a, b):
    return abs(a - b) / max(1e-12, abs(b))


# -- "Getting Started with Distributed Data Parallel" -------------------------------------------------------
DDP_LINE = re.compile(r"^(basic|loaded|checkpoint) rank (\d+) checksum (-?[0-9.]+)(?: loss ([0-9.]+))?$", re.M)


def _ddp_lines(out, n):
    got = {}
    for tag, rank, checksum, loss in DDP_LINE.findall(out):
        got.setdefault(tag, {})[int(rank)] = (float(checksum), None if loss == "" else float(loss))
    assert sorted(got) == ["basic", "checkpoint", "loaded"], out[-2000:]
    for tag, per_rank in got.items():
        assert sorted(per_rank) == list(range(n)), (tag, sorted(per_rank))
        sums = [c for c, _ in per_rank.values()]
        assert max(sums) - min(sums) <= 1e-6 * max(1.0, abs(sums[0])), f"{tag}: ranks hold different models {sums}"
    return got


@pytest.mark.serial
@pytest.mark.parametrize("n", RANKS)
def test_ddp_tutorial(n, tmp_path, tmp_path_factory):
    out = _ours("ddp_tutorial.py", n, tmp_path, env={"CKPT_DIR": str(tmp_path)})
    assert out.count("Running basic DDP example on rank") == n
    got = _ddp_lines(out, n)
    assert not os.path.exists(tmp_path / "model.checkpoint"), "rank 0 removes the checkpoint"
    theirs = _ddp_lines(_theirs("ddp_tutorial.py", tmp_path_factory), 2)
    assert sorted(theirs) == sorted(got)


# -- "Getting Started with Fully Sharded Data Parallel" (MNIST) ---------------------------------------------
FSDP_ARGS = ["--epochs", "2", "--batch-size", "16", "--test-batch-size", "32", "--train-size", "128",
             "--test-size", "64", "--save-model"]
TRAIN = re.compile(r"Train Epoch: (\d+) \tLoss: ([0-9.]+)")
TEST = re.compile(r"Test set: Average loss: ([0-9.]+), Accuracy: (\d+)/(\d+) \(([0-9.]+)%\)")


def _fsdp_checks(out):
    train = [(int(e), float(x)) for e, x in TRAIN.findall(out)]
    test = [(float(a), int(b), int(c)) for a, b, c, _ in TEST.findall(out)]
    assert [e for e, _ in train] == [1, 2] and len(test) == 2, out[-2000:]
    assert train[1][1] < train[0][1], f"the training loss did not fall: {train}"
    assert all(total == 64 for _, _, total in test), test
    return train, test


@pytest.mark.serial
@pytest.mark.parametrize("n", RANKS)
def test_fsdp_tutorial(n, tmp_path, tmp_path_factory):
    out = _ours("fsdp_tutorial.py", n, tmp_path, FSDP_ARGS)
    train, test = _fsdp_checks(out)
    assert "FullyShardedDataParallel(" in out and "CUDA event elapsed time:" in out
    # rank 0 saved the gathered model: the serial Net's names and shapes, loadable into a plain Net
    import importlib.util
    spec = importlib.util.spec_from_file_location("fsdp_tutorial_module", os.path.join(PORTED, "fsdp_tutorial.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import axonmpi
    net = mod.Net()
    missing = net.load_state_dict(axonmpi.load(str(tmp_path / "mnist_cnn.pt")))
    assert not missing.missing_keys and not missing.unexpected_keys
    theirs_train, theirs_test = _fsdp_checks(_theirs("fsdp_tutorial.py", tmp_path_factory, FSDP_ARGS))
    if n == 2:     # the same data, batches and schedule; the frameworks' initial weights and dropout differ
        for (e, ours), (_, ref) in zip(train, theirs_train):
            assert _rel(ours, ref) < 0.3, f"epoch {e}: training loss {ours} here, {ref} under torch"


# -- "Writing Distributed Applications with PyTorch" --------------------------------------------------------
NUM = r"[Tt]ensor\((-?[0-9.]+)\)"


def _dist_checks(out, n):
    data = [(int(r), float(v)) for r, v in re.findall(r"Rank  (\d+)  has data  " + NUM, out)]
    if n >= 2:
        # blocking and non-blocking p2p (ranks 0, 1: 1.0 each), then the all-reduce over new_group([0, 1]):
        # 2.0 on its ranks, the untouched 1.0 elsewhere (torch's rule for a rank outside the group)
        by_rank = {r: sorted(v for q, v in data if q == r) for r in range(n)}
        assert by_rank[0] == [1.0, 1.0, 2.0] and by_rank[1] == [1.0, 1.0, 2.0], by_rank
        assert all(by_rank[r] == [1.0] for r in range(2, n)), by_rank
        assert "Rank 0 started sending" in out and "Rank 1 started receiving" in out
    maxes = [float(v) for v in re.findall(r"has max  " + NUM, out)]
    assert maxes == [float(n)] * n, maxes
    ring = re.findall(r"ring sum  ([-0-9. ]+)\n", out)
    want = n * (n - 1) / 2
    assert len(ring) == n and all([float(x) for x in r.split()] == [want, 2 * want, 3 * want] for r in ring), ring
    sums = [float(v) for v in re.findall(r"parameter checksum  (-?[0-9.]+)", out)]
    assert len(sums) == n and max(sums) - min(sums) <= 1e-5 * max(1.0, abs(sums[0])), \
        f"average_gradients left the ranks with different models: {sums}"
    epochs = re.findall(r"Rank  (\d+) , epoch  (\d+) :  ([0-9.]+)", out)
    assert len(epochs) == 10 * n, len(epochs)
    return sums


@pytest.mark.serial
@pytest.mark.parametrize("n", RANKS)
def test_dist_tuto(n, tmp_path, tmp_path_factory):
    _dist_checks(_ours("dist_tuto.py", n, tmp_path), n)
    _dist_checks(_theirs("dist_tuto.py", tmp_path_factory), 2)


# -- the tensor-parallel example (parallelize_module, ColwiseParallel / RowwiseParallel) -------------------
TP_LINE = re.compile(r"^rank (\d+) iter (\d+) output sum (-?[0-9.]+)$", re.M)


def _tp_sums(out, n):
    got = {}
    for r, i, v in TP_LINE.findall(out):
        got.setdefault(int(i), {})[int(r)] = float(v)
    assert sorted(got) == list(range(10)) and all(sorted(v) == list(range(n)) for v in got.values()), got
    for i, per_rank in got.items():
        vals = list(per_rank.values())
        assert max(vals) - min(vals) <= 1e-5 * max(1.0, abs(vals[0])), f"iter {i}: ranks differ {per_rank}"
    return [got[i][0] for i in range(10)]


@pytest.mark.serial
@pytest.mark.parametrize("n", RANKS)
def test_tp_example(n, tmp_path, tmp_path_factory):
    ours = _tp_sums(_ours("tp_example.py", n, tmp_path), n)
    if n == 1:
        _THEIRS["tp_one_rank"] = ours
    else:       # column / row split over n ranks: the one-process numbers (float32)
        one = _THEIRS.get("tp_one_rank") or _tp_sums(_ours("tp_example.py", 1, tmp_path), 1)
        assert all(_rel(a, b) < 1e-5 for a, b in zip(ours, one)), (ours, one)
    _tp_sums(_theirs("tp_example.py", tmp_path_factory, torchrun=True), 2)


# -- the AxoNN user guide's steps (imports: AxoNN's and torch's) -------------------------------------------
AXONN_TORCH = ["import torch", "import torch.nn as nn", "import torch.distributed as dist",
               "from axonn import axonn as ax", "from axonn.intra_layer import auto_parallelize, sync_gradients",
               "from torch.utils.data import TensorDataset"]
AXONN_OURS = ["import axonmpi as torch", "import axonmpi.nn as nn", "import axonmpi.distributed as dist",
              "import axonmpi as ax", "from axonmpi.intra_layer import auto_parallelize, sync_gradients",
              "from axonmpi.utils.data import TensorDataset"]
AXONN_GRIDS = {1: "1,1,1,1", 2: "1,1,1,2", 4: "2,1,2,1"}     # G_data, G_intra_r, G_intra_c, G_intra_d
AXONN_LINE = r"epoch (\d+) step (\d+) loss ([0-9.]+)"


def _losses(stdout, pattern):
    got = {}
    for m in re.finditer(pattern, stdout):
        *key, loss = m.groups()
        got[tuple(key)] = float(loss)
    return got


def test_axonn_guide_imports():
    assert _import_lines(_source("axonn_guide.py")) == AXONN_OURS


def _axonn_under_torch(tmp_path):
    if "axonn" not in _THEIRS:
        pytest.importorskip("torch")
        text = _source("axonn_guide.py")
        a, b = text.index(BEGIN), text.index(END)
        path = tmp_path / "axonn_guide_torch.py"
        path.write_text(text[:a] + "\n".join(AXONN_TORCH) + "\n" + text[b:], encoding="utf-8")
        exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
        if exe is None:
            pytest.skip("torchrun not found beside torch")
        env = mpiexec_env({"PYTHONPATH": os.pathsep.join([os.path.join(PORTED, "torch_axonn"), ROOT])})
        r = subprocess.run([exe, "--standalone", "--nproc_per_node=1", str(path)], capture_output=True, text=True,
                           timeout=600, env=env, cwd=str(tmp_path))
        _THEIRS["axonn"] = _losses(_check(r, "axonn_guide under torch"), AXONN_LINE)
    return _THEIRS["axonn"]


@pytest.mark.serial
@pytest.mark.parametrize("n", RANKS)
def test_axonn_guide(n, tmp_path):
    r = run_mpiexec([os.path.join(PORTED, "axonn_guide.py")], n=n, timeout=600, cwd=str(tmp_path),
                    env={"AXONN_GRID": AXONN_GRIDS[n]})
    ours = _losses(_check(r, f"axonn_guide.py at {n} rank(s), grid {AXONN_GRIDS[n]}"), AXONN_LINE)
    assert len(ours) == 2 * 256 // 32, sorted(ours)
    assert ours[("1", "7")] < 0.5 * ours[("0", "0")], "training did not lower the loss"
    theirs = _axonn_under_torch(tmp_path)
    assert set(theirs) == set(ours)
    bad = {k: (ours[k], theirs[k]) for k in ours if abs(ours[k] - theirs[k]) > 1e-5 * max(1.0, abs(theirs[k]))}
    assert not bad, f"axonmpi at {n} rank(s) (grid {AXONN_GRIDS[n]}) vs the one-process torch run: {bad}"
