"""Megatron's vocabulary padding (``GPTConfig(padded_vocab_size=...)``, ``train_gpt.py --make-vocab-size-divisible-by``):
the padded GPT equals the unpadded one (loss, gradients of the real rows; the padding rows get none), never
samples a padding row, exports the real vocabulary, and under Megatron TP 2 on a vocabulary of 95 (which does not
divide by 2) trains step by step as the serial unpadded model (float64)."""
from __future__ import annotations

import numpy as np
import pytest

import axonmpi
import axonmpi.nn.functional as F
from axonmpi.models import GPT, GPTConfig
from axonmpi.models.gpt import padded_vocab_size

V, PAD = 95, 96
CFG = dict(vocab_size=V, block_size=8, n_layer=1, n_head=2, n_embd=16)


def _pair():
    """The unpadded GPT and the padded one holding the same weights (its padding rows random)."""
    axonmpi.manual_seed(3)
    ref = GPT(GPTConfig(**CFG), dtype=np.float64)
    axonmpi.manual_seed(4)
    pad = GPT(GPTConfig(**CFG, padded_vocab_size=PAD), dtype=np.float64)
    sd = ref.state_dict()
    for k in ("wte.weight", "lm_head.weight"):
        full = pad.state_dict()[k].copy()
        full[:V] = sd[k]
        full[V:] = 50.0                                  # would dominate every softmax if not masked
        sd[k] = full
    pad.load_state_dict(sd)
    return ref, pad


def _batch(step, b=4):
    rng = np.random.default_rng(10 + step)
    return rng.integers(0, V, (b, 8)), rng.integers(0, V, (b, 8))


def test_padded_vocab_size_is_megatrons_rule():
    assert padded_vocab_size(95, 1, 2) == 96 and padded_vocab_size(50257, 128) == 50304
    assert padded_vocab_size(96, 8, 4) == 96 and padded_vocab_size(97, 8, 4) == 128
    with pytest.raises(ValueError, match="positive int"):
        padded_vocab_size(95, 0)
    with pytest.raises(ValueError, match="padded_vocab_size"):
        GPTConfig(**CFG, padded_vocab_size=94)


def test_padded_gpt_equals_the_unpadded_one():
    ref, pad = _pair()
    x, y = _batch(0)
    lr, loss_r = ref(x, y)
    lp, loss_p = pad(x, y)
    assert lp.shape[-1] == PAD
    np.testing.assert_allclose(lp.data[..., :V], lr.data, rtol=1e-12, atol=1e-12)
    assert float(loss_p.item()) == pytest.approx(float(loss_r.item()), rel=1e-12)
    loss_r.backward()
    loss_p.backward()
    for k in ("wte.weight", "lm_head.weight"):
        gr, gp = dict(ref.named_parameters())[k].grad.data, dict(pad.named_parameters())[k].grad.data
        np.testing.assert_allclose(gp[:V], gr, rtol=1e-10, atol=1e-14)
        assert not np.any(gp[V:]), f"{k}: the padding rows got a gradient"


def test_padding_rows_are_never_sampled_and_not_exported():
    _, pad = _pair()
    axonmpi.manual_seed(0)
    out = pad.generate(np.zeros((8, 1), dtype=np.int64), max_new_tokens=24, temperature=2.0)
    assert int(out.max()) < V, "a padding row was sampled"
    hf = pad.to_hf_gpt2()
    assert hf["transformer.wte.weight"].shape[0] == V and hf["lm_head.weight"].shape[0] == V
    assert pad.hf_gpt2_config()["vocab_size"] == V


@pytest.mark.mpi(min_size=2)
def test_megatron_tp2_on_vocab_95_trains_as_the_serial_unpadded_model(world):
    """TP 2 needs the vocabulary split in two: 95 rows cannot be; 96 (one padding row) are. Each SGD step's loss,
    then every real row of every parameter, equal the serial unpadded GPT's."""
    if world.world_size % 2:
        pytest.skip("needs an even number of ranks")
    from axonmpi.optim import SGD
    from axonmpi.parallel import full_state_dict, parallelize
    from axonmpi.recipes.gpt import gpt_plan
    ref, pad = _pair()
    opt_r = SGD(ref.parameters(), lr=0.5)
    want = []
    for s in range(3):
        x, y = _batch(s)
        opt_r.zero_grad()
        _, loss = ref(x, y)
        loss.backward()
        opt_r.step()
        want.append(float(loss.item()))
    grid = axonmpi.ProcessGrid(world, G_intra_c=2)
    old, world.grid = world.grid, grid
    try:
        pm = parallelize(pad, grid=grid, tensor_parallel=gpt_plan(pad.config), data_parallel=None)
        opt = SGD(pm.parameters(), lr=0.5)
        for s in range(3):
            x, y = _batch(s)
            opt.zero_grad()
            logits, _ = pm(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            opt.step()
            assert float(loss.item()) == pytest.approx(want[s], rel=1e-10), f"step {s}"
        got = full_state_dict(pm)
        for k, v in ref.state_dict().items():
            np.testing.assert_allclose(np.asarray(got[k])[:v.shape[0]], v, rtol=1e-9, atol=1e-12, err_msg=k)
    finally:
        world.grid = old
        grid.free()
