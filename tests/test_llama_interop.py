"""Llama weights in and out against transformers' ``LlamaForCausalLM`` from small random ``LlamaConfig``s
(no download): grouped-query heads, tied and untied heads, Llama 3 rotary scaling.

- ``Llama.from_hf(state_dict, config)`` and ``Llama.from_hf(save_pretrained directory)``: logits equal
  transformers' as shipped to 1e-5 in float32.
- float64: transformers computes ``LlamaRMSNorm`` and the rotary tables in float32 even in a float64
  model, so it agrees with any float64 model to ~1e-7 only. With those two forwards patched to keep
  float64 (the rotary frequencies' float32 formula is checked in ``test_llama_layers.py``), logits, loss
  and every gradient equal to 1e-12 and the parameters after 3 AdamW steps to 1e-10.
- ``save_hf(directory)`` -> ``LlamaForCausalLM.from_pretrained(directory)``: every key loaded, logits equal
  (float32 1e-5 as shipped; float64 1e-12 patched).

Skips without torch/transformers (``make test-interop`` installs them).
"""
import json

import numpy as np
import pytest

import axonmpi
from axonmpi.models import Llama, LlamaConfig
from axonmpi.nn.rotary import rope_inv_freq

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

V, T, B = 53, 11, 3
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
          "original_max_position_embeddings": 8}
CASES = {   # name: (num_key_value_heads, tie_word_embeddings, rope_scaling)
    "gqa": (2, False, None), "mha_tied": (4, True, None), "mqa_llama3": (1, False, LLAMA3),
}


def _hf_config(case, dtype=torch.float32):
    n_kv, tied, scaling = CASES[case]
    return transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=n_kv, max_position_embeddings=32, rope_theta=300.0,
        rope_scaling=dict(scaling) if scaling else None,     # transformers writes rope_theta into the dict it gets
        rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, dtype=dtype)


def _hf(case, dtype):
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(_hf_config(case, dtype)).to(dtype).eval()
    with torch.no_grad():   # the norms start at one: move every weight so every mapping shows
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


@pytest.fixture
def float64_transformers(monkeypatch):
    """transformers' Llama with its two float32 islands (RMSNorm statistics, rotary tables) kept in the
    model's dtype; the rest of its forward is untouched."""
    def rms_norm(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        c = self.config
        inv = torch.from_numpy(rope_inv_freq(c.head_dim, c.rope_parameters["rope_theta"], c.rope_parameters))
        freqs = position_ids[..., None].double() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", rotary)


def _close(a, b, tol, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    err = np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b)))
    assert err <= tol, f"{what}: relative difference {err:.3g} > {tol}"


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


def _ours_logits(model, idx):
    with axonmpi.no_grad():
        return model(idx)[0].numpy()


def _their_logits(hf, idx):
    with torch.no_grad():
        return hf(torch.from_numpy(idx)).logits.numpy()


@pytest.mark.serial
@pytest.mark.parametrize("case", sorted(CASES))
def test_from_hf_float32_logits_equal_transformers_as_shipped(case):
    hf = _hf(case, torch.float32)
    ours = Llama.from_hf(hf.state_dict(), hf.config)
    n_kv, tied, scaling = CASES[case]
    c = ours.config
    assert (c.vocab_size, c.n_embd, c.n_layer, c.n_head, c.n_kv_head, c.intermediate_size, c.head_dim) == \
        (V, 32, 2, 4, n_kv, 48, 8)
    assert (c.tie_word_embeddings, c.rope_theta, c.rms_norm_eps, c.rope_scaling) == (tied, 300.0, 1e-5, scaling)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    assert ours.model.embed_tokens.weight.dtype == np.float32
    assert list(ours.state_dict()) == list(hf.state_dict())          # the same names, in the same order
    idx, _ = _batch()
    _close(_ours_logits(ours, idx), _their_logits(hf, idx), 1e-5, f"{case}: logits")
    # positions past the rotary scaling's original context and given explicitly (position_ids)
    pos = np.arange(20, 20 + T)[None].repeat(B, 0)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(idx), position_ids=torch.from_numpy(pos)).logits.numpy()
    with axonmpi.no_grad():
        _close(ours(idx, positions=pos)[0].numpy(), theirs, 1e-5, f"{case}: logits at positions 20..")


@pytest.mark.serial
@pytest.mark.parametrize("case", sorted(CASES))
def test_float64_logits_loss_grads_and_three_adamw_steps(case, float64_transformers):
    hf = _hf(case, torch.float64)
    ours = Llama.from_hf(hf.state_dict(), hf.config)
    assert ours.model.embed_tokens.weight.dtype == np.float64
    hopt = torch.optim.AdamW(hf.parameters(), lr=1e-2, weight_decay=0.1)
    opt = axonmpi.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    params = dict(ours.named_parameters())
    for step in range(3):
        idx, tgt = _batch(step)
        hopt.zero_grad()
        opt.zero_grad()
        out = hf(torch.from_numpy(idx))
        hloss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V), torch.from_numpy(tgt).reshape(-1))
        hloss.backward()
        logits, loss = ours(idx, tgt)
        loss.backward()
        _close(logits.numpy(), out.logits.detach().numpy(), 1e-12, f"{case} step {step}: logits")
        _close(loss.item(), hloss.item(), 1e-12, f"{case} step {step}: loss")
        for n, p in hf.named_parameters():
            _close(params[n].grad.numpy(), p.grad.numpy(), 1e-11, f"{case} step {step}: grad {n}")
        hopt.step()
        opt.step()
    for k, v in hf.state_dict().items():
        _close(ours.state_dict()[k], v.numpy(), 1e-10, f"{case} after 3 steps: {k}")


def _random_ours(case, dtype):
    n_kv, tied, scaling = CASES[case]
    axonmpi.manual_seed(7)
    model = Llama(LlamaConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_kv_head=n_kv, intermediate_size=48,
                              block_size=32, rope_theta=300.0, rope_scaling=scaling, rms_norm_eps=1e-5,
                              tie_word_embeddings=tied), dtype=dtype)
    rng = np.random.default_rng(7)
    with axonmpi.no_grad():
        for p in model.parameters():
            p.data[...] += (0.05 * rng.standard_normal(p.shape)).astype(p.data.dtype)
    return model


@pytest.mark.serial
@pytest.mark.parametrize("case", sorted(CASES))
def test_save_hf_loads_in_transformers_float32(case, tmp_path):
    ours = _random_ours(case, np.float32)
    written = ours.save_hf(tmp_path)
    assert sorted(p.rsplit("/", 1)[1] for p in written) == ["config.json", "model.safetensors"]
    hf, info = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert hf.config.tie_word_embeddings == CASES[case][1]
    idx, _ = _batch(3)
    _close(_their_logits(hf.eval(), idx), _ours_logits(ours, idx), 1e-5, f"{case}: from_pretrained logits")
    # and back: the directory gives the same model
    back = Llama.from_hf(str(tmp_path))
    assert back.config == ours.config
    _close(_ours_logits(back, idx), _ours_logits(ours, idx), 0.0, f"{case}: from_hf(save_hf) logits")


@pytest.mark.serial
@pytest.mark.parametrize("case", sorted(CASES))
def test_save_hf_loads_in_transformers_float64(case, tmp_path, float64_transformers):
    ours = _random_ours(case, np.float64)
    ours.save_hf(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float64"
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float64).eval()
    idx, _ = _batch(4)
    _close(_their_logits(hf, idx), _ours_logits(ours, idx), 1e-12, f"{case}: from_pretrained logits (float64)")


@pytest.mark.serial
@pytest.mark.parametrize("case", sorted(CASES))
def test_save_pretrained_directory_reads_into_our_llama(case, tmp_path, float64_transformers):
    hf = _hf(case, torch.float64)
    hf.save_pretrained(str(tmp_path))
    ours = Llama.from_hf(str(tmp_path))
    assert ours.config.n_kv_head == CASES[case][0] and ours.config.tie_word_embeddings == CASES[case][1]
    idx, _ = _batch(5)
    _close(_ours_logits(ours, idx), _their_logits(hf, idx), 1e-12, f"{case}: save_pretrained -> from_hf logits")


@pytest.mark.serial
def test_from_hf_accepts_a_llama_model_state_dict_and_refuses_what_it_cannot_compute():
    hf = _hf("gqa", torch.float32)
    bare = {k[len("model."):]: v for k, v in hf.state_dict().items() if k.startswith("model.")}
    with pytest.raises(ValueError, match="no lm_head.weight"):
        Llama.from_hf(bare, hf.config)           # untied config, no head
    sd = {**bare, "lm_head.weight": hf.state_dict()["lm_head.weight"]}
    assert np.array_equal(Llama.from_hf(sd, hf.config).lm_head.weight.numpy(), sd["lm_head.weight"].numpy())
    cfg = hf.config.to_dict()
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        Llama.from_hf(hf.state_dict(), {**cfg, "hidden_act": "gelu"})
    with pytest.raises(NotImplementedError, match="yarn"):
        Llama.from_hf(hf.state_dict(), {**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                                                                   "rope_theta": 300.0}})
    with pytest.raises(ValueError, match="needs config="):
        Llama.from_hf(hf.state_dict())
