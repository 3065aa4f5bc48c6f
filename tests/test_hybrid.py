"""Hybrid DP x TP x PP through the user-facing path: examples/train_gpt.py under every layout equals one process."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
# float64, 5 AdamW steps with active clipping (norms ~1 vs --grad-clip 0.05), a tiny GPT
TINY = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "8", "--corpus-bytes", "60000",
        "--eval-batches", "1", "--no-progress", "--sample-chars", "0", "--global-batch", "12", "--steps", "5",
        "--dtype", "float64", "--no-save", "--lr", "1e-2", "--grad-clip", "0.05", "--warmup", "2"]

# (G_data, G_inter, G_intra_r, G_intra_c, G_intra_d), extra flags
LAYOUTS = [
    ((2, 2, 1, 1, 1), ["--microbatches", "2"]),
    ((2, 1, 1, 2, 1), ["--tp-style", "megatron"]),
    ((2, 1, 1, 2, 1), ["--tp-style", "axonn"]),
    ((1, 2, 1, 2, 1), ["--tp-style", "megatron", "--schedule", "gpipe", "--microbatches", "3"]),
    ((1, 2, 1, 1, 2), ["--schedule", "interleaved", "--microbatches", "2"]),
    ((1, 1, 2, 1, 2), []),
    ((1, 1, 2, 2, 1), ["--activation-checkpointing"]),
    ((4, 1, 1, 1, 1), []),
    ((3, 1, 1, 1, 1), []),
    ((1, 3, 1, 1, 1), ["--microbatches", "3"]),
    ((1, 1, 1, 3, 1), ["--tp-style", "axonn"]),
]


def _run(tmp, name, sizes=None, extra=()):
    from axonmpi.testing import mpiexec_env, run_mpiexec
    metrics, params = str(tmp / f"{name}.jsonl"), str(tmp / f"{name}.npz")
    args = [SCRIPT, *TINY, "--metrics-json", metrics, "--dump-params", params, *extra]
    if sizes is None:
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=mpiexec_env(),
                           cwd=tmp)
    else:
        flags = [f for k, v in zip(("--G-data", "--G-inter", "--G-intra-r", "--G-intra-c", "--G-intra-d"), sizes)
                 for f in (k, str(v))]
        r = run_mpiexec(args + flags, n=int(np.prod(sizes)), timeout=240, cwd=str(tmp))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(ln) for ln in open(metrics)]
    return rows, dict(np.load(params)), r


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serial")
    return _run(tmp, "serial")


@pytest.mark.serial
@pytest.mark.parametrize("sizes,extra", LAYOUTS, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple)
                         else "-".join(a.strip("-") for a in v) or "default")
def test_layout_matches_one_process(sizes, extra, serial, tmp_path):
    ref_rows, ref_params, _ = serial
    rows, params, r = _run(tmp_path, "layout", sizes, extra)
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5]
    ref_loss, loss = np.array([x["loss"] for x in ref_rows]), np.array([x["loss"] for x in rows])
    assert np.abs(loss - ref_loss).max() <= 1e-9 * np.abs(ref_loss).max(), (loss, ref_loss)
    ref_norm, norm = np.array([x["grad_norm"] for x in ref_rows]), np.array([x["grad_norm"] for x in rows])
    assert np.all(ref_norm > 0.05)                      # clipping is active
    assert np.abs(norm - ref_norm).max() <= 1e-9 * ref_norm.max(), (norm, ref_norm)
    assert params.keys() == ref_params.keys()
    for k, v in ref_params.items():
        scale = max(np.abs(v).max(), 1e-300)
        assert params[k].shape == v.shape and np.abs(params[k] - v).max() <= 1e-9 * scale, k
    assert r.stdout.count("ProcessGrid(") == 1          # rank 0 prints the grid table once
