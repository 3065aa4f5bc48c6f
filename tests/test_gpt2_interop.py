"""GPT-2 weights in and out: ``GPT.from_hf_gpt2`` / ``gpt.to_hf_gpt2`` against transformers'
``GPT2LMHeadModel`` from a small random ``GPT2Config`` (no download): logits equal (float32 1e-5,
float64 1e-10), loss and every gradient equal, equal again after an optimizer step.
Skips without torch/transformers (``make test-interop`` installs them)."""
import numpy as np
import pytest

import axonmpi
from axonmpi.models import GPT, GPTConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, T, B = 61, 12, 3


def _hf(dtype):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    m = transformers.GPT2LMHeadModel(cfg).to(dtype).eval()
    with torch.no_grad():  # HF zero-initialises biases and LayerNorm: randomise so every mapping shows
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def _close(a, b, tol, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    err = np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b)))
    assert err <= tol, f"{what}: relative difference {err:.3g} > {tol}"


def _grads(gpt):
    """Our gradients under HF names, Conv1D ones transposed (the tied lm_head shares wte's)."""
    params = dict(gpt.named_parameters())
    params["lm_head.weight"] = gpt.lm_head.weight
    out = {}
    for ours, hf_name in zip(gpt.state_dict(), gpt.to_hf_gpt2()):
        g = params[ours].grad.numpy()
        out[hf_name] = g.T if ours.endswith(("qkv.weight", "proj.weight", "fc.weight")) else g
    return out


@pytest.mark.serial
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_gpt2_logits_loss_grads_and_a_step(dtype, tol):
    hf = _hf(dtype)
    gpt = GPT.from_hf_gpt2(hf.state_dict(), n_head=4)
    c = gpt.config
    assert (c.vocab_size, c.block_size, c.n_layer, c.n_head, c.n_embd, c.tie_word_embeddings) == (V, 16, 2, 4, 32, True)
    assert gpt.lm_head.weight is gpt.wte.weight
    np_dt = np.float32 if dtype == torch.float32 else np.float64
    assert gpt.wte.weight.data.dtype == np_dt
    rng = np.random.default_rng(0)
    idx, tgt = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    # SGD: Adam would turn the key bias's gradient (zero in exact arithmetic: softmax ignores a
    # shift shared by all keys) into +-lr steps of rounding noise, in both libraries alike
    hopt = torch.optim.SGD(hf.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    opt = axonmpi.optim.SGD(gpt.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    for step in range(3):
        hopt.zero_grad()
        opt.zero_grad()
        out = hf(torch.from_numpy(idx))
        hloss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V), torch.from_numpy(tgt).reshape(-1))
        hloss.backward()
        logits, loss = gpt(idx, tgt)
        loss.backward()
        _close(logits.numpy(), out.logits.detach().numpy(), tol, f"step {step}: logits")
        _close(loss.item(), hloss.item(), tol, f"step {step}: loss")
        ref = {n: p.grad.numpy() for n, p in hf.named_parameters()}
        ref["lm_head.weight"] = ref["transformer.wte.weight"]      # tied: one gradient
        ours = _grads(gpt)
        assert set(ours) == set(ref)
        for k in ref:
            _close(ours[k], ref[k], tol, f"step {step}: grad {k}")
        hopt.step()
        opt.step()
    for k, v in hf.state_dict().items():
        if k in gpt.to_hf_gpt2():
            _close(gpt.to_hf_gpt2()[k], v.numpy(), tol, f"after 3 steps: {k}")


@pytest.mark.serial
def test_to_hf_gpt2_loads_into_transformers():
    axonmpi.manual_seed(3)
    gpt = GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_word_embeddings=True),
              dtype=np.float64)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)).double().eval()
    sd = gpt.to_hf_gpt2()
    assert sd["transformer.h.1.mlp.c_fc.weight"].shape == (32, 128)        # Conv1D: (in, out)
    res = hf.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
    assert not res.missing_keys and not res.unexpected_keys
    idx = np.random.default_rng(1).integers(0, V, (2, 9))
    _close(gpt(idx)[0].numpy(), hf(torch.from_numpy(idx)).logits.detach().numpy(), 1e-10, "logits")
    back = GPT.from_hf_gpt2(hf.state_dict(), n_head=2)
    for k, v in gpt.state_dict().items():
        assert np.array_equal(back.state_dict()[k], v), k


@pytest.mark.serial
def test_from_hf_gpt2_errors_and_untied_head():
    sd = {k: v.numpy() for k, v in _hf(torch.float32).state_dict().items()}
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0                  # untied: kept separate
    gpt = GPT.from_hf_gpt2(sd, n_head=4)
    assert not gpt.config.tie_word_embeddings and gpt.lm_head.weight is not gpt.wte.weight
    assert np.array_equal(gpt.to_hf_gpt2()["lm_head.weight"], sd["lm_head.weight"])
    with pytest.raises(ValueError, match="multiple of 64"):
        GPT.from_hf_gpt2(sd)
    with pytest.raises(ValueError, match="unknown GPT-2 key 'h.0.attn.q_proj.weight'"):
        GPT.from_hf_gpt2({**sd, "transformer.h.0.attn.q_proj.weight": sd["transformer.wte.weight"]}, n_head=4)
