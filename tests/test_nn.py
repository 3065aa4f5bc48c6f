"""nn: module registration, state dicts, init statistics, modes, dtypes, containers."""
import math

import numpy as np
import pytest

from axonmpi import nn
from axonmpi import random as R
from axonmpi.autograd import Tensor, gradcheck


def test_sequential_state_dict_keys_and_layout():
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    sd = m.state_dict()
    assert list(sd) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert sd["0.weight"].shape == (4, 3) and sd["2.weight"].shape == (2, 4)
    assert all(type(v) is np.ndarray for v in sd.values())
    sd["0.weight"][...] = 99  # a copy, not a view
    assert not (m[0].weight.numpy() == 99).any()
    assert [n for n, _ in m.named_parameters()] == list(sd)
    assert len(list(m.parameters())) == 4 and len(m) == 3 and isinstance(m[1], nn.ReLU)


def test_load_state_dict_roundtrip_in_place_keeps_dtype():
    R.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 4, dtype="float64"), nn.Tanh(), nn.Linear(4, 2, dtype="float64"))
    b = nn.Sequential(nn.Linear(3, 4, dtype="float64"), nn.Tanh(), nn.Linear(4, 2, dtype="float64"))
    arr_before = b[0].weight.data
    res = b.load_state_dict({k: v.astype(np.float32) for k, v in a.state_dict().items()})
    assert res.missing_keys == [] and res.unexpected_keys == []
    assert b[0].weight.data is arr_before and b[0].weight.dtype == np.float64
    np.testing.assert_allclose(b[0].weight.numpy(), a[0].weight.numpy(), rtol=1e-6)


def test_load_state_dict_reports_all_problems_at_once():
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    sd = m.state_dict()
    del sd["0.bias"], sd["2.bias"]
    sd["extra.weight"] = np.zeros(1)
    sd["2.weight"] = np.zeros((3, 3))
    with pytest.raises(RuntimeError) as e:
        m.load_state_dict(sd)
    msg = str(e.value)
    for needle in ("'0.bias'", "'2.bias'", "'extra.weight'", "2.weight", "(3, 3)", "(2, 4)"):
        assert needle in msg
    del sd["2.weight"]
    res = m.load_state_dict(sd, strict=False)
    assert sorted(res.missing_keys) == ["0.bias", "2.bias", "2.weight"]
    assert res.unexpected_keys == ["extra.weight"]


def test_buffers_persistent_and_not():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("running", np.zeros(3))
            self.register_buffer("scratch", np.ones(2), persistent=False)
            self.fc = nn.Linear(2, 2)

    m = M()
    assert [n for n, _ in m.named_buffers()] == ["running", "scratch"]
    assert list(m.state_dict()) == ["running", "fc.weight", "fc.bias"]
    assert isinstance(m.running, Tensor)
    m.running = np.full(3, 5.0)
    assert m.state_dict()["running"][0] == 5.0


def test_nested_names_modules_and_children():
    blk = nn.TransformerBlock(8, 2)
    names = dict(blk.named_modules())
    assert {"", "ln_1", "attn", "attn.qkv", "attn.proj", "mlp", "mlp.fc"} <= set(names)
    assert [n for n, _ in blk.named_children()] == ["ln_1", "attn", "ln_2", "mlp"]
    ml = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
    md = nn.ModuleDict({"a": nn.Linear(2, 3)})
    holder = nn.Sequential(ml[0], ml[1])  # shared modules: parameters counted once
    assert len(list(holder.parameters())) == 4
    assert "a.weight" in md.state_dict() and "1.bias" in ml.state_dict()
    assert "Linear(in_features=2, out_features=3, bias=True)" in repr(md)


def test_linear_init_matches_pytorch_bounds():
    R.manual_seed(3)
    fc = nn.Linear(400, 300)
    w, b = fc.weight.numpy(), fc.bias.numpy()
    bound = 1 / math.sqrt(400)
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound
    assert abs(w.std() - bound / math.sqrt(3)) < 0.02 * bound  # uniform std = bound / sqrt(3)
    assert abs(w.mean()) < 0.01 * bound
    emb = nn.Embedding(1000, 64)
    assert abs(emb.weight.numpy().std() - 1.0) < 0.02
    ln = nn.LayerNorm(5)
    assert (ln.weight.numpy() == 1).all() and (ln.bias.numpy() == 0).all()


def test_seed_reproducibility_across_dtypes():
    R.manual_seed(11)
    a = nn.Linear(5, 4, dtype="float64")
    R.manual_seed(11)
    b = nn.Linear(5, 4)
    assert b.weight.dtype == np.float32
    np.testing.assert_allclose(a.weight.numpy(), b.weight.numpy(), rtol=1e-6)
    state = R.get_rng_state()
    import json

    json.dumps(state)
    x1 = R.default_generator().standard_normal(3)
    R.set_rng_state(state)
    np.testing.assert_array_equal(R.default_generator().standard_normal(3), x1)


def test_train_eval_controls_dropout():
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    x = Tensor(np.ones((64, 4), np.float32))          # the layer's dtype (float64 input raises, as in torch)
    m.eval()
    assert not m[1].training
    np.testing.assert_array_equal(m(x).numpy(), m(x).numpy())
    m.train()
    assert m.training and m[1].training
    assert (m(x).numpy() == 0).any()


def test_zero_grad_and_to_dtype():
    m = nn.Sequential(nn.Linear(3, 2))
    m(Tensor(np.ones((1, 3), np.float32))).sum().backward()
    assert m[0].weight.grad is not None
    m.zero_grad(set_to_none=False)
    assert (m[0].weight.grad.numpy() == 0).all()
    m.zero_grad()
    assert m[0].weight.grad is None
    w = m[0].weight
    m.to(np.float64)
    assert m[0].weight is w and w.dtype == np.float64


@pytest.mark.parametrize("layer", [
    lambda: nn.Sequential(nn.Linear(3, 5, dtype="float64"), nn.GELU(), nn.Linear(5, 2, dtype="float64")),
    lambda: nn.Sequential(nn.LayerNorm(3, dtype="float64"), nn.SiLU(), nn.Linear(3, 2, dtype="float64"), nn.Sigmoid()),
    lambda: nn.CausalSelfAttention(6, 2, dtype="float64"),
    lambda: nn.TransformerBlock(6, 3, dtype="float64"),
], ids=["mlp", "ln_silu", "attention", "block"])
def test_module_parameter_gradcheck_float64(layer):
    R.manual_seed(5)
    m = layer()
    shape = (2, 4, 6) if isinstance(m, (nn.CausalSelfAttention, nn.TransformerBlock)) else (4, 3)
    x = Tensor(np.random.default_rng(1).standard_normal(shape), requires_grad=True, dtype=np.float64)
    params = list(m.parameters())
    assert all(p.dtype == np.float64 for p in params)
    assert gradcheck(lambda x, *ps: m(x), [x] + params, atol=1e-7, rtol=1e-5, max_entries=20)


def test_attention_is_causal_and_matches_numpy():
    R.manual_seed(2)
    att = nn.CausalSelfAttention(4, 2, dtype="float64")
    x = np.random.default_rng(0).standard_normal((1, 5, 4))
    y = att(Tensor(x)).numpy()
    Wq, bq = att.qkv.weight.numpy(), att.qkv.bias.numpy()
    qkv = x @ Wq.T + bq
    q, k, v = np.split(qkv, 3, axis=-1)
    heads = []
    for h in range(2):
        s = slice(2 * h, 2 * h + 2)
        a = q[0, :, s] @ k[0, :, s].T / math.sqrt(2)
        a = np.where(np.triu(np.ones((5, 5)), 1) > 0, -np.inf, a)
        a = np.exp(a - a.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        heads.append(a @ v[0, :, s])
    ref = np.concatenate(heads, -1) @ att.proj.weight.numpy().T + att.proj.bias.numpy()
    np.testing.assert_allclose(y[0], ref, rtol=1e-10, atol=1e-12)
    x2 = x.copy()
    x2[0, 3:] += 1.0  # changing the future leaves earlier outputs unchanged
    np.testing.assert_allclose(att(Tensor(x2)).numpy()[0, :3], y[0, :3], rtol=1e-12)


def test_unknown_options_raise():
    with pytest.raises(ValueError):
        nn.GELU(approximate="fast")
    with pytest.raises(ValueError):
        nn.Dropout(1.5)
    with pytest.raises(ValueError):
        nn.CausalSelfAttention(6, 4)
