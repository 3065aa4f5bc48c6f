"""GPT: shapes, loss at init, spot gradcheck of parameters, reproducibility, generation."""
import math

import numpy as np
import pytest

from axonmpi import random as R
from axonmpi.autograd import Tensor, gradcheck
from axonmpi.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)


def _batch(B=2, T=6, seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, CFG.vocab_size, (B, T))
    return idx, np.roll(idx, -1, axis=1)


def test_forward_shapes_and_initial_loss():
    R.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32))
    idx = np.random.default_rng(0).integers(0, 50, (4, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (4, 16, 50) and logits.dtype == np.float32
    assert abs(loss.item() - math.log(50)) < 0.1  # near-uniform predictions at init
    logits, loss = model(idx)
    assert loss is None


def test_parameter_names_counts_and_init():
    R.manual_seed(0)
    model = GPT(CFG)
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["wte.weight", "wpe.weight"]
    assert "blocks.1.attn.qkv.bias" in names and names[-1] == "lm_head.weight"
    C, V, L = CFG.n_embd, CFG.vocab_size, CFG.n_layer
    per_block = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) + (4 * C * C + C)
    expected = V * C + CFG.block_size * C + L * per_block + 2 * C + V * C
    assert model.num_parameters() == expected
    big = GPT(GPTConfig(vocab_size=100, block_size=64, n_layer=4, n_head=4, n_embd=128))
    assert abs(big.blocks[0].mlp.fc.weight.numpy().std() - 0.02) < 0.002
    assert abs(big.blocks[0].mlp.proj.weight.numpy().std() - 0.02 / math.sqrt(8)) < 0.001
    assert (big.blocks[0].attn.qkv.bias.numpy() == 0).all()


def test_seed_makes_models_identical():
    R.manual_seed(42)
    a = GPT(CFG)
    R.manual_seed(42)
    b = GPT(CFG)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb
        np.testing.assert_array_equal(va, vb)


@pytest.mark.parametrize("pname", ["wte.weight", "wpe.weight", "blocks.0.attn.qkv.weight",
                                   "blocks.1.mlp.proj.bias", "blocks.0.ln_1.weight", "ln_f.bias",
                                   "lm_head.weight"])
def test_gpt_parameter_gradients_spot_check(pname):
    R.manual_seed(1)
    model = GPT(CFG, dtype="float64")
    idx, tgt = _batch()
    tgt[0, 2] = -100  # ignored target
    p = model.get_parameter(pname)
    assert p.dtype == np.float64
    assert gradcheck(lambda q: model(idx, tgt)[1], [p], atol=1e-8, rtol=1e-5, max_entries=6)


def test_float32_float64_models_agree():
    R.manual_seed(3)
    m64 = GPT(CFG, dtype="float64")
    R.manual_seed(3)
    m32 = GPT(CFG)
    idx, tgt = _batch()
    _, l64 = m64(idx, tgt)
    _, l32 = m32(idx, tgt)
    assert abs(l64.item() - l32.item()) < 1e-5


def test_dropout_config_train_vs_eval():
    R.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.3))
    idx, _ = _batch()
    model.eval()
    a, _ = model(idx)
    b, _ = model(idx)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    model.train()
    c, _ = model(idx)
    assert not np.allclose(a.numpy(), c.numpy())


def test_generate_shapes_and_reproducible():
    R.manual_seed(0)
    model = GPT(CFG)
    idx, _ = _batch(T=3)
    R.manual_seed(9)
    out1 = model.generate(idx, 10, temperature=0.8, top_k=3)
    R.manual_seed(9)
    out2 = model.generate(idx, 10, temperature=0.8, top_k=3)
    assert out1.shape == (2, 13)  # longer than block_size: the context is cropped
    np.testing.assert_array_equal(out1, out2)
    np.testing.assert_array_equal(out1[:, :3], idx)
    assert out1.min() >= 0 and out1.max() < CFG.vocab_size
    assert isinstance(model.generate(Tensor(idx), 1), Tensor)


def test_training_reduces_loss():
    R.manual_seed(0)
    model = GPT(CFG, dtype="float64")
    idx, tgt = _batch(B=4, T=8)
    losses = []
    for _ in range(60):
        model.zero_grad()
        _, loss = model(idx, tgt)
        loss.backward()
        losses.append(loss.item())
        for p in model.parameters():
            p.data -= 1.0 * p.grad.data
    assert losses[-1] < 0.5 * losses[0]


def test_config_validation():
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(vocab_size=10, block_size=4, n_layer=1, n_head=3, n_embd=8)
    with pytest.raises(ValueError, match="block_size"):
        GPT(CFG)(np.zeros((1, CFG.block_size + 1), np.int64))
    with pytest.raises(Exception):
        CFG.n_layer = 3  # frozen
