"""The Llama block's layers: ``nn.RMSNorm``, ``nn.RotaryEmbedding`` + ``F.apply_rotary_emb``,
``nn.GroupedQueryAttention`` and ``nn.SwiGLU``.

Every backward against central finite differences (float64); the attention against a NumPy reference
written here (keys and values repeated per group, causal softmax) and the rotary invariance (scores
depend on relative positions only); with torch installed (``make test-interop``), values and gradients
equal torch's ``nn.RMSNorm`` and transformers' ``LlamaRotaryEmbedding`` / ``apply_rotary_pos_emb`` /
``LlamaAttention`` / ``LlamaMLP`` to float64 precision.
"""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn.functional as F
from axonmpi import Tensor, nn
from axonmpi.autograd import gradcheck
from axonmpi.nn.rotary import rope_inv_freq

TOL = 1e-12
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def _t(*shape, seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True, dtype=np.float64)


def _close(got, want, tol=TOL, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shapes {got.shape} vs {want.shape}"
    err = np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want)))
    assert err <= tol, f"{what}: relative difference {err:.3g} > {tol}"


def _randomise(module, seed=1, scale=0.3):
    rng = np.random.default_rng(seed)
    with axonmpi.no_grad():
        for p in module.parameters():
            p.data[...] = scale * rng.standard_normal(p.shape)
    return module


# -- gradcheck ---------------------------------------------------------------------------------------

@pytest.mark.serial
def test_rms_norm_module_and_functional_gradcheck():
    norm = _randomise(nn.RMSNorm((3, 4), eps=1e-4, dtype=np.float64))
    x = _t(2, 3, 4)
    assert gradcheck(lambda a, w: F.rms_norm(a, (3, 4), w, 1e-4), [x, norm.weight])
    assert gradcheck(lambda a: norm(a), [x])
    plain = nn.RMSNorm(4, elementwise_affine=False, dtype=np.float64)
    assert plain.weight is None and list(plain.state_dict()) == []
    assert gradcheck(lambda a: plain(a), [_t(3, 4, seed=2)])
    # eps=None: the machine epsilon of the input's dtype (torch's default)
    y = nn.RMSNorm(2, dtype=np.float64)(Tensor(np.array([[0.0, 0.0]])))
    assert np.array_equal(y.numpy(), [[0.0, 0.0]])
    _close(F.rms_norm(Tensor(np.array([3.0, 4.0])), 2, eps=0.0), np.array([3.0, 4.0]) / np.sqrt(12.5))


@pytest.mark.serial
def test_rotary_gradcheck_and_a_rotation_keeps_the_norm():
    x = _t(2, 5, 3, 8)
    cos, sin = nn.RotaryEmbedding(8, theta=100.0, scaling=LLAMA3)(x)
    assert cos.shape == (5, 8)
    assert gradcheck(lambda a: F.apply_rotary_emb(a, cos[:, None, :], sin[:, None, :]), [x])
    y = F.apply_rotary_emb(x, cos[:, None, :], sin[:, None, :])
    _close(np.linalg.norm(y.numpy(), axis=-1), np.linalg.norm(x.numpy(), axis=-1), what="rotation norm")
    # pairs (i, i + d/2) turn by position * inv_freq[i]: position 1, pair 0 is a turn by 1 radian
    e0 = np.zeros((1, 1, 8))
    e0[..., 0] = 1.0
    c1, s1 = nn.RotaryEmbedding(8)(x, positions=np.array([1]))
    _close(F.apply_rotary_emb(Tensor(e0), c1[:, None, :], s1[:, None, :]).numpy()[0, 0, [0, 4]], [np.cos(1), np.sin(1)])
    with pytest.raises(ValueError, match="must broadcast"):
        F.apply_rotary_emb(x, cos, sin)            # (5, 8) against (2, 5, 3, 8): heads not broadcast
    with pytest.raises(ValueError, match="even"):
        F.apply_rotary_emb(_t(2, 3), np.ones(3), np.ones(3))


@pytest.mark.serial
def test_swiglu_gradcheck_and_values():
    g, u = _t(3, 4), _t(3, 4, seed=1)
    assert gradcheck(F.swiglu, [g, u])
    _close(F.swiglu(g, u), g.numpy() / (1 + np.exp(-g.numpy())) * u.numpy())
    mlp = _randomise(nn.SwiGLU(4, 6, dtype=np.float64))
    assert list(mlp.state_dict()) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    x = _t(2, 3, 4)
    assert gradcheck(lambda a, w: mlp(a), [x, mlp.gate_proj.weight])


@pytest.mark.serial
@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_grouped_query_attention_gradcheck(n_kv):
    attn = _randomise(nn.GroupedQueryAttention(8, 4, n_kv, head_dim=4, dtype=np.float64))
    x = _t(2, 5, 8)
    rope = nn.RotaryEmbedding(4, theta=50.0)(x)
    assert gradcheck(lambda a, wq, wk: attn(a, rope), [x, attn.q_proj.weight, attn.k_proj.weight], max_entries=40)


# -- the attention against a NumPy reference -----------------------------------------------------------

def _reference_attention(attn, x, cos, sin):
    """transformers' eager Llama attention in NumPy: repeat_kv, causal softmax."""
    W = {n: p.numpy() for n, p in attn.named_parameters()}
    B, T, _ = x.shape
    hd, nh, nkv = attn.head_dim, attn.n_head, attn.n_kv_head

    def heads(w, n):
        return (x @ w.T).reshape(B, T, n, hd).transpose(0, 2, 1, 3)

    def rope(a):
        rot = np.concatenate([-a[..., hd // 2:], a[..., :hd // 2]], -1)
        return a * cos + rot * sin
    q, k, v = rope(heads(W["q_proj.weight"], nh)), rope(heads(W["k_proj.weight"], nkv)), heads(W["v_proj.weight"], nkv)
    k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    s = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    y = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, nh * hd)
    return y @ W["o_proj.weight"].T


@pytest.mark.serial
@pytest.mark.parametrize("n_kv", [1, 2, 6])
def test_grouped_query_attention_matches_repeat_kv_reference(n_kv):
    attn = _randomise(nn.GroupedQueryAttention(12, 6, n_kv, dtype=np.float64))
    assert list(attn.state_dict()) == [f"{n}_proj.weight" for n in "qkvo"]
    assert attn.k_proj.weight.shape == (2 * n_kv, 12)
    x = _t(2, 7, 12)
    cos, sin = nn.RotaryEmbedding(2, theta=30.0)(x)
    _close(attn(x, (cos, sin)), _reference_attention(attn, x.numpy(), cos, sin), what="attention")
    # no position embeddings: plain causal grouped-query attention
    _close(attn(x), _reference_attention(attn, x.numpy(), np.ones_like(cos), np.zeros_like(sin)), what="no rope")


@pytest.mark.serial
def test_rotary_scores_depend_on_relative_positions_only():
    """Positions shifted by a constant (a sequence's tokens 100..106 fed alone, as context parallelism
    feeds a part of a sequence) give the same attention output; other positions do not."""
    attn = _randomise(nn.GroupedQueryAttention(8, 4, 2, dtype=np.float64))
    rope = nn.RotaryEmbedding(2, theta=10.0)
    x = _t(1, 7, 8)
    base = attn(x, rope(x)).numpy()
    _close(attn(x, rope(x, positions=np.arange(7))).numpy(), base, what="explicit 0..T-1")
    _close(attn(x, rope(x, positions=np.arange(100, 107))).numpy(), base, tol=1e-10, what="shifted positions")
    _close(attn(x, rope(x, positions=np.arange(100, 107)[None].repeat(1, 0))).numpy(), base, tol=1e-10,
           what="(B, T) positions")
    assert np.abs(attn(x, rope(x, positions=np.arange(0, 14, 2))).numpy() - base).max() > 1e-3


@pytest.mark.serial
def test_local_heads_come_from_the_projected_width():
    """A q/k/v projection cut to whole heads (a tensor-parallel rank's share) runs its heads with the same
    forward; a cut through a head raises naming the divisibility rule."""
    full = _randomise(nn.GroupedQueryAttention(8, 4, 2, dtype=np.float64))
    x = _t(1, 5, 8)
    rope = nn.RotaryEmbedding(2)(x)
    part = nn.GroupedQueryAttention(8, 4, 2, dtype=np.float64)
    # rank 0 of 2: query heads 0, 1 and key/value head 0; o_proj keeps its input columns for those heads
    from axonmpi.nn.parameter import Parameter
    for n, rows in (("q_proj", slice(0, 4)), ("k_proj", slice(0, 2)), ("v_proj", slice(0, 2))):
        getattr(part, n).weight = Parameter(getattr(full, n).weight.numpy()[rows].copy())
    part.o_proj.weight = Parameter(full.o_proj.weight.numpy()[:, :4].copy())
    other = nn.GroupedQueryAttention(8, 4, 2, dtype=np.float64)
    for n, rows in (("q_proj", slice(4, 8)), ("k_proj", slice(2, 4)), ("v_proj", slice(2, 4))):
        getattr(other, n).weight = Parameter(getattr(full, n).weight.numpy()[rows].copy())
    other.o_proj.weight = Parameter(full.o_proj.weight.numpy()[:, 4:].copy())
    _close(part(x, rope).numpy() + other(x, rope).numpy(), full(x, rope).numpy(), what="two halves summed")
    bad = nn.GroupedQueryAttention(8, 4, 2, dtype=np.float64)
    bad.k_proj.weight = Parameter(full.k_proj.weight.numpy()[:1].copy())
    with pytest.raises(ValueError, match="whole heads"):
        bad(x, rope)
    with pytest.raises(ValueError, match="must divide n_head"):
        nn.GroupedQueryAttention(8, 4, 3)


@pytest.mark.serial
def test_rope_frequencies_and_scaling_options():
    _close(rope_inv_freq(4, theta=100.0), [1.0, 0.1])
    inv = rope_inv_freq(16, 500000.0)
    scaled = rope_inv_freq(16, 500000.0, LLAMA3)
    wavelen = 2 * np.pi / inv
    assert np.array_equal(scaled[wavelen < 32 / 4], inv[wavelen < 32 / 4])           # high frequencies kept
    _close(scaled[wavelen > 32], inv[wavelen > 32] / 8)                               # low ones divided by factor
    _close(rope_inv_freq(8, scaling={"type": "linear", "factor": 4.0}), rope_inv_freq(8) / 4)
    assert rope_inv_freq(8, scaling={"rope_type": "default", "rope_theta": 10000.0}) is not None
    with pytest.raises(NotImplementedError, match="yarn"):
        nn.RotaryEmbedding(8, scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="needs 'low_freq_factor'"):
        nn.RotaryEmbedding(8, scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(TypeError, match="integers"):
        nn.RotaryEmbedding(8)(_t(1, 2, 8), positions=np.array([0.0, 1.0]))


# -- against torch / transformers ----------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch")


def _modeling_llama():
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama
    return modeling_llama


@pytest.mark.serial
@pytest.mark.parametrize("shape,eps,affine", [(8, None, True), ((3, 8), 1e-5, True), (8, 1e-6, False)])
def test_rms_norm_matches_torch(shape, eps, affine):
    torch = _torch()
    ours = _randomise(nn.RMSNorm(shape, eps=eps, elementwise_affine=affine, dtype=np.float64), scale=1.0)
    theirs = torch.nn.RMSNorm(shape, eps=eps, elementwise_affine=affine, dtype=torch.float64)
    if affine:
        with torch.no_grad():
            theirs.weight.copy_(torch.from_numpy(ours.weight.numpy()))
    x = _t(2, 3, 8)
    g = np.random.default_rng(5).standard_normal(x.shape)
    y = ours(x)
    y.backward(Tensor(g))
    xt = torch.from_numpy(x.numpy()).requires_grad_()
    yt = theirs(xt)
    yt.backward(torch.from_numpy(g))
    _close(y.numpy(), yt.detach().numpy(), what="forward")
    _close(x.grad.numpy(), xt.grad.numpy(), what="input grad")
    if affine:
        _close(ours.weight.grad.numpy(), theirs.weight.grad.numpy(), what="weight grad")


@pytest.mark.serial
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_rotary_tables_match_transformers(scaling):
    """transformers computes the frequencies and angles in float32: equal to float32 precision; the
    rotation itself (``apply_rotary_pos_emb`` on our float64 tables) to float64 precision."""
    torch = _torch()
    ml = _modeling_llama()
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=5000.0,
                                   rope_scaling=dict(scaling) if scaling else None,   # transformers writes into it
                                   max_position_embeddings=64)
    hf = ml.LlamaRotaryEmbedding(cfg)
    ours = nn.RotaryEmbedding(16, theta=5000.0, scaling=scaling)
    _close(ours.inv_freq, hf.inv_freq.double().numpy(), tol=1e-6, what="inv_freq")
    pos = np.array([[0, 3, 17, 40]])
    x = _t(1, 2, 4, 16)
    cos, sin = ours(x, positions=pos)                                        # (1, 4, 16)
    hcos, hsin = hf(torch.zeros(1, dtype=torch.float64), torch.from_numpy(pos))
    _close(cos, hcos.numpy(), tol=1e-5, what="cos")
    _close(sin, hsin.numpy(), tol=1e-5, what="sin")
    g = np.random.default_rng(3).standard_normal(x.shape)
    y = F.apply_rotary_emb(x, cos[:, None], sin[:, None])                  # x: (B, H, T, d) as transformers'
    y.backward(Tensor(g))
    xt = torch.from_numpy(x.numpy()).requires_grad_()
    yt, _ = ml.apply_rotary_pos_emb(xt, xt, torch.from_numpy(cos), torch.from_numpy(sin))
    yt.backward(torch.from_numpy(g))
    _close(y.numpy(), yt.detach().numpy(), what="rotated")
    _close(x.grad.numpy(), xt.grad.numpy(), what="rotation grad")


def _hf_config(n_kv, **kw):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=24, intermediate_size=40, num_attention_heads=6,
                                   num_key_value_heads=n_kv, rope_theta=40.0, **kw)
    cfg._attn_implementation = "sdpa"        # float64 throughout (the eager path softmaxes in float32)
    return cfg


@pytest.mark.serial
@pytest.mark.parametrize("n_kv", [1, 3, 6])
def test_grouped_query_attention_matches_transformers(n_kv):
    torch = _torch()
    ml = _modeling_llama()
    torch.manual_seed(n_kv)
    hf = ml.LlamaAttention(_hf_config(n_kv), layer_idx=0).to(torch.float64)
    ours = nn.GroupedQueryAttention(24, 6, n_kv, dtype=np.float64)
    ours.load_state_dict({k: v.detach().numpy() for k, v in hf.state_dict().items()})
    x = _t(2, 9, 24)
    cos, sin = nn.RotaryEmbedding(4, theta=40.0)(x)
    g = np.random.default_rng(4).standard_normal(x.shape)
    y = ours(x, (cos, sin))
    y.backward(Tensor(g))
    xt = torch.from_numpy(x.numpy()).requires_grad_()
    yt, _ = hf(xt, position_embeddings=(torch.from_numpy(cos)[None], torch.from_numpy(sin)[None]),
               attention_mask=None)
    yt.backward(torch.from_numpy(g))
    _close(y.numpy(), yt.detach().numpy(), what="attention")
    _close(x.grad.numpy(), xt.grad.numpy(), what="input grad")
    for n, p in hf.named_parameters():
        _close(dict(ours.named_parameters())[n].grad.numpy(), p.grad.numpy(), what=f"grad {n}")


@pytest.mark.serial
def test_swiglu_matches_transformers_llama_mlp():
    torch = _torch()
    ml = _modeling_llama()
    torch.manual_seed(0)
    hf = ml.LlamaMLP(_hf_config(6)).to(torch.float64)
    ours = nn.SwiGLU(24, 40, dtype=np.float64)
    ours.load_state_dict({k: v.detach().numpy() for k, v in hf.state_dict().items()})
    x = _t(2, 3, 24)
    g = np.random.default_rng(6).standard_normal(x.shape)
    y = ours(x)
    y.backward(Tensor(g))
    xt = torch.from_numpy(x.numpy()).requires_grad_()
    yt = hf(xt)
    yt.backward(torch.from_numpy(g))
    _close(y.numpy(), yt.detach().numpy(), what="mlp")
    _close(x.grad.numpy(), xt.grad.numpy(), what="input grad")
    for n, p in hf.named_parameters():
        _close(dict(ours.named_parameters())[n].grad.numpy(), p.grad.numpy(), what=f"grad {n}")
