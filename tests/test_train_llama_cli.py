"""``examples/train_gpt.py --model llama`` end to end at small sizes (``mpiexec -n 2`` subprocesses, as
``tests/test_examples_cli.py`` runs the demo): a 2-rank layout equals one process step by step, a checkpoint it
saved resumes under another 2-rank layout to the uninterrupted run's steps and weights, and exports with
``axonmpi ckpt export --format hf-llama``."""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
sys.path.insert(0, os.path.join(ROOT, "examples"))
TINY = ["--model", "llama", "--n-layer", "2", "--n-embd", "16", "--n-head", "4", "--n-kv-head", "1", "--ffn-hidden",
        "24", "--rope-theta", "500", "--block-size", "8", "--corpus-bytes", "60000", "--eval-batches", "1",
        "--no-progress", "--sample-chars", "0", "--global-batch", "8", "--steps", "5", "--dtype", "float64",
        "--lr", "1e-2", "--grad-clip", "0.05", "--warmup", "2"]


def _train(tmp, name, n, extra=()):
    from axonmpi.testing import mpiexec_env, run_mpiexec
    metrics, params = str(tmp / f"{name}.jsonl"), str(tmp / f"{name}.npz")
    args = [SCRIPT, *TINY, "--metrics-json", metrics, "--dump-params", params, *extra]
    if "--checkpoint-dir" not in extra:
        args.append("--no-save")
    if n == 1:
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180, env=mpiexec_env(),
                           cwd=tmp)
    else:
        r = run_mpiexec(args, n=n, timeout=240, cwd=str(tmp))
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    return [json.loads(ln) for ln in open(metrics)], dict(np.load(params)), r


def _same(rows, params, ref_rows, ref_params, steps):
    ref = {x["step"]: x for x in ref_rows}
    assert [x["step"] for x in rows] == list(steps)
    for x in rows:
        for key in ("loss", "grad_norm"):
            assert abs(x[key] - ref[x["step"]][key]) <= 1e-9 * abs(ref[x["step"]][key]), (key, x, ref[x["step"]])
    assert params.keys() == ref_params.keys()
    for k, v in ref_params.items():
        assert np.abs(params[k] - v).max() <= 1e-9 * np.abs(v).max(), k


@pytest.mark.serial
def test_train_llama_layouts_resume_and_export(tmp_path):
    """One process, 5 steps: the reference.  2 ranks of tensor parallelism (the one key/value head on both) with
    sequence parallelism, saving at step 3: equal at every step.  Resumed from step 3 as a 2-stage ZB-H1 pipeline:
    steps 4 and 5 and the weights equal the reference.  The step-3 checkpoint exports to a transformers Llama
    directory that ``Llama.from_hf`` reads with its weights."""
    from axonmpi import checkpoint as ckpt
    from axonmpi.checkpoint import cli as ckpt_cli
    from axonmpi.checkpoint import CheckpointManager
    from axonmpi.interop import EXPORT_FORMATS
    from axonmpi.models import Llama
    ref_rows, ref_params, r = _train(tmp_path, "serial", 1)
    assert "Llama (rank 0 trains" in r.stderr + r.stdout
    ck = str(tmp_path / "ck")
    rows, params, r = _train(tmp_path, "tp2", 2, ["--G-intra-c", "2", "--tp-style", "megatron", "--sequence-parallel",
                                                  "--checkpoint-dir", ck, "--save-every", "3"])
    _same(rows, params, ref_rows, ref_params, (1, 2, 3, 4, 5))
    mgr = CheckpointManager(ck)
    assert 3 in mgr.steps()
    for s in mgr.steps():
        if s > 3:
            shutil.rmtree(mgr.path_for(s))
    rows, params, _ = _train(tmp_path, "pp2", 2, ["--G-inter", "2", "--schedule", "zb-h1", "--microbatches", "2",
                                                  "--checkpoint-dir", ck, "--resume", "--no-save"])
    _same(rows, params, ref_rows, ref_params, (4, 5))
    out = str(tmp_path / "hf")
    with contextlib.redirect_stdout(io.StringIO()):
        assert ckpt_cli.main(["export", mgr.path_for(3), out, "--format", "hf-llama"], formats=EXPORT_FORMATS) == 0
    back = Llama.from_hf(out)
    assert back.config.n_kv_head == 1 and back.config.rope_theta == 500.0 and back.config.intermediate_size == 24
    saved = ckpt.load(mgr.path_for(3))["model"]
    for k, v in back.state_dict().items():
        np.testing.assert_array_equal(v, np.asarray(saved[k]))


@pytest.mark.serial
def test_train_llama_flags_are_refused_with_the_other_model():
    """A Llama flag without --model llama, and a GPT-only option with it, stop with one line naming the fix."""
    import train_gpt

    for argv, said in ((["--n-kv-head", "1"], "--n-kv-head is a Llama option: add --model llama"),
                       (["--model", "llama", "--moe-experts", "2"], "the Llama recipe has no MoE variant"),
                       (["--model", "llama", "--dropout", "0.1"], "the Llama has no dropout"),
                       (["--model", "llama", "--n-kv-head", "0"], "--n-kv-head must be a whole number >= 1")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
            train_gpt.parse_args(argv)
        assert e.value.code == 2 and said in err.getvalue(), (argv, err.getvalue())


@pytest.mark.serial
def test_llama_generate_with_top_k_1_is_greedy():
    """``Llama.generate`` (the trainer's sample) with ``top_k=1`` appends the argmax of the last position's logits,
    the context cut to ``block_size``."""
    import axonmpi
    from axonmpi.models import Llama, LlamaConfig
    axonmpi.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=20, n_embd=16, n_layer=1, n_head=2, n_kv_head=1, block_size=6),
                  dtype=np.float64)
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    out = model.generate(ids, 5, top_k=1)
    want = ids
    with axonmpi.no_grad():
        for _ in range(5):
            logits = model(want[:, -6:])[0].numpy()
            want = np.concatenate([want, logits[:, -1].argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(out, want)
