"""Fine-tuning from Hugging Face weights (docs/finetune.md): a tiny random GPT-2 and a tiny random Llama, built with
``transformers`` and saved locally (nothing downloaded), with a vocabulary of 257 that 2 does not divide, are
fine-tuned by ``examples/train_gpt.py --init-from hf:DIR --data DIR --layout tp=2,pp=2,dp=1`` at 4 ranks on a token
file from ``examples/prepare_data.py``.  The first step's loss is transformers' loss of the same batch (the weights
came in whole, the GPT's vocabulary padded to 258 rows for the layout); the checkpoint exports with ``axonmpi ckpt
export --format hf-gpt2 / hf-llama`` to 257 rows, and transformers' ``from_pretrained`` of the export gives the
logits of the trained weights.  (The 8-rank TP2 x PP2 x DP2 run is docs/finetune.md's command; at ~40 s on the
2-core development machine it is not part of the N-D pass.)

``test_finetune_md_as_written`` (slow) runs docs/finetune.md's shell blocks as printed, in order, in a folder that
looks like a clone after ``make install``: the 4-rank walk and section 5, a GPT-2 and a Llama fine-tuned under
TP2 x PP2 x DP2 at 8 ranks, each resubmitted with ``--steps`` doubled into the same run folder, exported and
compared with transformers' logits."""
import contextlib
import io
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
sys.path.insert(0, os.path.join(ROOT, "examples"))
V, T, GB = 257, 16, 4


def _hf(kind, path):
    """A random tiny transformers model of vocabulary 257 saved with save_pretrained (safetensors)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=V - 1, eos_token_id=V - 1)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       bos_token_id=1, eos_token_id=2)
        model = transformers.LlamaForCausalLM(cfg)
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(path)
    return model.eval()


def _first_batch(data_dir):
    """The trainer's first global batch (one data replica): DistributedSampler's epoch-0 permutation."""
    from axonmpi.data import TokenFileDataset
    ds = TokenFileDataset(os.path.join(data_dir, "train.bin"), T)
    return ds.get_batch(np.random.default_rng((0, 0)).permutation(len(ds))[:GB])


@pytest.mark.serial
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_finetune_from_hf_under_tp2_pp2_and_export(kind, tmp_path):
    import prepare_data
    from axonmpi import checkpoint as ckpt
    from axonmpi.checkpoint import cli as ckpt_cli
    from axonmpi.interop import EXPORT_FORMATS
    from axonmpi.testing import run_mpiexec
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = _hf(kind, str(tmp_path / "hf"))
    import sysconfig
    (tmp_path / "in.txt").write_text(open(os.path.join(sysconfig.get_paths()["stdlib"], "argparse.py")).read()[:8000])
    with contextlib.redirect_stdout(io.StringIO()):
        prepare_data.main([str(tmp_path / "in.txt"), "--out", str(tmp_path / "data")])    # bytes: ids < 256 < 257
    ck = str(tmp_path / "run")
    r = run_mpiexec([SCRIPT, "--init-from", f"hf:{tmp_path / 'hf'}", "--data", str(tmp_path / "data"),
                     "--layout", "tp=2,pp=2,dp=1,schedule=1f1b", "--block-size", str(T), "--global-batch", str(GB),
                     "--steps", "2", "--checkpoint-dir", ck, "--eval-batches", "1", "--sample-chars", "0",
                     "--no-progress", "--dtype", "float64"], n=4, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"--init-from hf:{tmp_path / 'hf'}: {kind} weights loaded (vocabulary {V}" in r.stderr
    rows = [json.loads(x) for x in open(os.path.join(ck, "metrics.jsonl"))]
    x, y = _first_batch(str(tmp_path / "data"))
    with torch.no_grad():
        want = hf.double()(torch.from_numpy(x)).logits
        loss = torch.nn.functional.cross_entropy(want.reshape(-1, V), torch.from_numpy(y).reshape(-1))
    # transformers computes the Llama's rotary tables in float32 even in a float64 model: 1e-6 there
    tol = 1e-9 if kind == "gpt2" else 1e-6
    assert rows[0]["loss"] == pytest.approx(float(loss), rel=tol)           # the HF weights, whole, at step 1
    path = ckpt.CheckpointManager(ck).latest()
    saved = ckpt.load(path)["model"]
    emb = "wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
    assert saved[emb].shape[0] == V + 1                                     # padded for tp=2 (both models)
    out = str(tmp_path / "export")
    with contextlib.redirect_stdout(io.StringIO()):
        assert ckpt_cli.main(["export", path, out, "--format", f"hf-{kind}"], formats=EXPORT_FORMATS) == 0
    cls = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM
    with contextlib.redirect_stderr(io.StringIO()):
        back = cls.from_pretrained(out).eval().double()
    assert back.config.vocab_size == V
    key = "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
    np.testing.assert_array_equal(back.state_dict()[key].numpy(), saved[emb][:V])
    assert not np.array_equal(saved[emb][:V], hf.state_dict()[key].numpy())       # it trained
    from axonmpi.models import GPT, Llama
    ours = (GPT if kind == "gpt2" else Llama).from_hf(out, dtype=np.float64)
    ours.eval()
    with torch.no_grad():
        theirs = back(torch.from_numpy(x)).logits.numpy()
    np.testing.assert_allclose(ours(x)[0].numpy(), theirs, rtol=tol, atol=tol)


def _finetune_md_blocks():
    """docs/finetune.md's bash blocks in order: the unmarked ones and those whose norun reason names this file."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_docs import _SHELL, _fences
    path = os.path.join(ROOT, "docs", "finetune.md")
    lines = open(path, encoding="utf-8").read().splitlines()
    return [(i + 1, "\n".join(lines[i + 1:j]) + "\n") for i, j, lang, prev in _fences(lines)
            if lang.lower() in _SHELL and (not prev.startswith("<!-- norun") or "tests/test_finetune.py" in prev)]


@pytest.mark.slow
@pytest.mark.serial
def test_finetune_md_as_written(tmp_path):
    """docs/finetune.md, every shell block as printed: text tokenized; a tiny HF GPT-2 and a tiny HF Llama (vocabulary
    257, padded to 258 for tp=2) fine-tuned from ``--init-from hf:DIR`` under TP2 x PP2 x DP2 at 8 ranks; each
    resubmitted with ``--steps`` doubled continues in its run folder (steps 5-8 after 1-4, the resumed step named
    in the log); exported and loaded in transformers with the logits of axonmpi's model of the export."""
    import faulthandler
    import subprocess
    import time
    faulthandler.dump_traceback_later(3600, exit=True, file=sys.__stderr__)     # the conftest watchdog's 180 s, stretched for this walk
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from axonmpi.testing import mpiexec_env
    for name in os.listdir(ROOT):
        if name not in (".git", ".venv") and not name.startswith(".test"):
            os.symlink(os.path.join(ROOT, name), tmp_path / name)
    os.symlink(sys.prefix, tmp_path / ".venv")
    blocks, said, took = _finetune_md_blocks(), [], []
    assert any("mpiexec -n 8" in code and "tp=2,pp=2,dp=2" in code for _, code in blocks)
    for line, code in blocks:
        t0 = time.perf_counter()
        r = subprocess.run(["bash", "-eo", "pipefail", "-c", code], capture_output=True, text=True, timeout=1200,
                           env=mpiexec_env(), cwd=str(tmp_path))
        took.append((line, round(time.perf_counter() - t0, 1)))
        assert r.returncode == 0, (f"docs/finetune.md:{line} failed, exit {r.returncode}\n--- stdout\n"
                                   f"{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
        said.append(r.stdout + r.stderr)
    print("docs/finetune.md blocks (line, seconds):", took)
    for model in ("gpt2", "llama"):
        run = tmp_path / "ft" / f"{model}-run8"
        rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
        assert [x["step"] for x in rows] == list(range(1, 9)), model        # one folder, steps 1-4 then 5-8
        assert sorted(p.name for p in run.glob("step-*")) == ["step-00000004", "step-00000008"], model
        first = open(tmp_path / "ft" / f"{model}-run8-4.log").read()
        assert f"weights loaded (vocabulary {V}, padded to {V + 1} rows for the layout)" in first, first[-2000:]
        again = open(tmp_path / "ft" / f"{model}-run8-8.log").read()
        assert "LR schedule extended from 4 to 8 steps" in again and "weights loaded" not in again, again[-2000:]
    out = "".join(said)
    for model in ("gpt2", "llama"):
        assert f"{model} vocabulary {V} | max |logit difference|" in out


def test_a_padded_llama_equals_the_unpadded_one(tmp_path):
    """``LlamaConfig(padded_vocab_size=...)``: the padding rows' logits are masked, so loss and gradients equal the
    unpadded model's (the padding rows get none); ``to_hf`` / ``save_hf`` write the real vocabulary; the Megatron plan
    splits the padded vocabulary over the tensor group where the real one does not divide."""
    from axonmpi.models import Llama, LlamaConfig
    from axonmpi.recipes.llama import llama_layout_errors, llama_plan
    shape = dict(vocab_size=V, n_embd=16, n_layer=1, n_head=4, n_kv_head=2, intermediate_size=32)
    plain, padded = LlamaConfig(**shape), LlamaConfig(**shape, padded_vocab_size=V + 3)
    a, b = Llama(plain, dtype=np.float64), Llama(padded, dtype=np.float64)
    sd = a.state_dict()
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        sd[k] = np.concatenate([sd[k], np.ones((3, 16))])          # the padding rows' values never matter
    b.load_state_dict(sd)
    x = np.random.default_rng(0).integers(0, V, (2, 8))
    (la, loss_a), (lb, loss_b) = a(x, x), b(x, x)
    assert lb.shape == (2, 8, V + 3) and float(loss_b.item()) == pytest.approx(float(loss_a.item()), rel=1e-13)
    loss_a.backward()
    loss_b.backward()
    ga, gb = a.lm_head.weight.grad.numpy(), b.lm_head.weight.grad.numpy()
    np.testing.assert_allclose(gb[:V], ga, rtol=1e-12, atol=1e-15)
    assert not gb[V:].any()
    assert b.to_hf()["lm_head.weight"].shape == (V, 16)
    b.save_hf(str(tmp_path / "hf"))
    back = Llama.from_hf(str(tmp_path / "hf"), dtype=np.float64)
    assert back.config.vocab_size == V and back.config.padded_vocab_size is None
    np.testing.assert_allclose(back(x)[0].numpy(), la.numpy(), rtol=1e-12, atol=1e-13)
    assert "model.embed_tokens" not in llama_plan(plain, 2) and llama_plan(padded, 2)["model.embed_tokens"] == "vocab"
    assert llama_layout_errors(padded, 2, sequence_parallel=True) == []
    assert "pad it with --make-vocab-size-divisible-by" in llama_layout_errors(plain, 2, sequence_parallel=True)[0]
    with pytest.raises(ValueError, match="padded_vocab_size must be None or an int >= vocab_size"):
        LlamaConfig(**shape, padded_vocab_size=V - 1)
