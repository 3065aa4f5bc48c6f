"""issue 48 item 6: nanoGPT's ``train.py`` and ``model.py`` (tests/ported/nanogpt, MIT), ported by the import rule
alone, train under ``mpiexec -n 2`` through their own DDP branch (``init_process_group``, ``RANK`` / ``LOCAL_RANK`` /
``WORLD_SIZE``, ``cuda:{LOCAL_RANK}`` on a CPU host, the ``autocast`` context, ``GradScaler(enabled=False)``,
``np.memmap`` data, ``--compile=False``) and equal the same files under torch (one process, gradient accumulation
over both ranks' micro-batches) from the same initial weights for 20 steps: every printed loss, and every weight
of the step-20 checkpoint (float32 tolerance).  The checkpoint then resumes (``--init_from=resume``) and steps
20-24 equal torch's uninterrupted run.

The initial weights are handed over as a ``--init_from=resume`` checkpoint at iteration 0, written in each
framework's own format from one set of arrays.  The token file (``examples/nanogpt_tokens.py``) holds
``block_size + 1`` tokens, so every window ``get_batch`` draws is the same one: the two frameworks' random streams
(different by design) cannot make the batches differ.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from axonmpi.testing import mpiexec_env, run_mpiexec
from test_ported import undo_rule

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "tests", "ported", "nanogpt")
BLOCK = 32
MODEL_ARGS = dict(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, bias=False, vocab_size=None, dropout=0.0)
ARGS = ["--dataset=stdlib_char", "--compile=False", "--device=cpu", "--dtype=float32", "--n_layer=2", "--n_head=2",
        "--n_embd=32", f"--block_size={BLOCK}", "--batch_size=2", "--gradient_accumulation_steps=4",
        "--eval_interval=20", "--eval_iters=2", "--log_interval=1", "--learning_rate=1e-3", "--warmup_iters=5",
        "--lr_decay_iters=20", "--min_lr=1e-4", "--always_save_checkpoint=True", "--init_from=resume",
        "--grad_clip=1.0", "--weight_decay=0.1"]
LOSS = re.compile(r"^iter (\d+): loss ([0-9.]+),", re.M)

INIT = """
import sys, numpy as np
{imports}
from model import GPTConfig, GPT
args = {args!r}
model = GPT(GPTConfig(**args))
w = np.load(sys.argv[1])
if {load}:
    model.load_state_dict({{k: torch.from_numpy(w[k]) for k in w.files}})
else:
    np.savez(sys.argv[1], **{{k: v.detach().numpy() for k, v in model.state_dict().items()}})
opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
torch.save({{"model": model.state_dict(), "optimizer": opt.state_dict(), "model_args": args, "iter_num": 0,
            "best_val_loss": 1e9, "config": {{}}}}, sys.argv[2])
"""


def _copy(dst, torch_version):
    for name in ("model.py", "train.py", "configurator.py"):
        text = open(os.path.join(SRC, name), encoding="utf-8").read()
        if torch_version:
            text = "\n".join(undo_rule(ln) if ln.startswith(("import axonmpi", "from axonmpi")) else ln
                             for ln in text.splitlines()) + "\n"
            assert "axonmpi" not in text
        (dst / name).write_text(text, encoding="utf-8")


def _run(cmd, cwd, timeout=600):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(cwd),
                       env=mpiexec_env({"PYTHONPATH": ROOT}))
    assert r.returncode == 0, f"{cmd[:3]} failed\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    return r.stdout


def _losses(out):
    return {int(i): float(v) for i, v in LOSS.findall(out)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(torch's losses 0..24, its step-20 weights), and the axonmpi runs' (losses 0..20, step-20 weights, losses
    20..24 resumed)."""
    base = tmp_path_factory.mktemp("nanogpt")
    ours, theirs = base / "ours", base / "theirs"
    for d, is_torch in ((ours, False), (theirs, True)):
        d.mkdir()
        _copy(d, is_torch)
        _run([sys.executable, os.path.join(ROOT, "examples", "nanogpt_tokens.py"), "--out",
              str(d / "data" / "stdlib_char"), "--max-bytes", "200000", "--tokens", str(BLOCK + 1)], d)
    import pickle
    vocab = pickle.load(open(ours / "data" / "stdlib_char" / "meta.pkl", "rb"))["vocab_size"]
    args = dict(MODEL_ARGS, vocab_size=vocab)
    weights = base / "init.npz"
    np.savez(weights)
    (theirs / "out").mkdir()
    (ours / "out").mkdir()
    (theirs / "init.py").write_text(INIT.format(imports="import torch", args=args, load=False))
    (ours / "init.py").write_text(INIT.format(imports="import axonmpi as torch", args=args, load=True))
    _run([sys.executable, "init.py", str(weights), "out/ckpt.pt"], theirs)      # torch's init, handed over
    _run([sys.executable, "init.py", str(weights), "out/ckpt.pt"], ours)
    t_out = _run([sys.executable, "train.py", *ARGS, "--max_iters=24", "--out_dir=out"], theirs)
    t_weights = {k: v.numpy() for k, v in torch.load(theirs / "out" / "ckpt.pt")["model"].items()}
    r = run_mpiexec(["train.py", *ARGS, "--max_iters=20", "--out_dir=out"], n=2, timeout=600, cwd=str(ours))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import axonmpi
    o_weights = axonmpi.load(str(ours / "out" / "ckpt.pt"))["model"]
    r2 = run_mpiexec(["train.py", *ARGS, "--max_iters=24", "--out_dir=out"], n=2, timeout=600, cwd=str(ours))
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    return _losses(t_out), t_weights, _losses(r.stdout), o_weights, _losses(r2.stdout), r.stdout


@pytest.mark.serial
def test_train_py_at_two_ranks_matches_torch_for_20_steps(runs):
    t_loss, t_w, o_loss, o_w, _, out = runs
    assert "tokens per iteration will be: 256" in out          # its DDP branch: 2 ranks x 2 micro-steps x 2 x 32
    assert sorted(o_loss) == list(range(21)), out[-2000:]
    for i in range(21):
        assert abs(o_loss[i] - t_loss[i]) <= 1.5e-4, (i, o_loss[i], t_loss[i])     # printed with 4 decimals
    assert o_loss[20] < o_loss[0] - 0.2                         # it trains
    assert sorted(o_w) == sorted(t_w)
    for k, v in t_w.items():
        np.testing.assert_allclose(o_w[k], v, rtol=2e-4, atol=2e-5, err_msg=k)


@pytest.mark.serial
def test_its_checkpoint_resumes(runs):
    t_loss, _, _, _, resumed, _ = runs
    assert sorted(resumed) == list(range(20, 25))
    for i in range(20, 25):
        assert abs(resumed[i] - t_loss[i]) <= 1.5e-4, (i, resumed[i], t_loss[i])
