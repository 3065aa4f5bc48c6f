"""Fine-tuning from Hugging Face weights (docs/finetune.md): a tiny random GPT-2 and a tiny random Llama, built with
``transformers`` and saved locally (nothing downloaded), with a vocabulary of 257 that 2 does not divide, are
fine-tuned by ``examples/train_gpt.py --init-from hf:DIR --data DIR --layout tp=2,pp=2,dp=1`` at 4 ranks on a token
file from ``examples/prepare_data.py``.  The first step's loss is transformers' loss of the same batch (the weights
came in whole, the GPT's vocabulary padded to 258 rows for the layout); the checkpoint exports with ``axonmpi ckpt
export --format hf-gpt2 / hf-llama`` to 257 rows, and transformers' ``from_pretrained`` of the export gives the
logits of the trained weights.  (The 8-rank TP2 x PP2 x DP2 run is docs/finetune.md's command; at ~40 s on the
2-core development machine it is not part of the N-D pass.)"""
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
    assert saved[emb].shape[0] == (V + 1 if kind == "gpt2" else V)         # the GPT padded for tp=2
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
