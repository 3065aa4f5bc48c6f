"""B/W split: ``backward_input`` then ``WeightGradients.run`` gives the bits of one ordinary backward."""
import numpy as np
import pytest

from axonmpi import nn
from axonmpi.autograd import Tensor
from axonmpi.autograd import ops_nn as F
from axonmpi.autograd.split_backward import backward_input
from axonmpi.models.gpt import GPT, GPTConfig
from axonmpi.random import manual_seed


def _mlp(seed=0):
    manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7, dtype=np.float64), nn.LayerNorm(7, dtype=np.float64), nn.GELU(),
                         nn.Linear(7, 3, dtype=np.float64))


def _grads(model):
    return {k: (None if q.grad is None else q.grad.numpy().copy()) for k, q in model.named_parameters()}


def _run(model, x, split: bool, steps=2):
    """Two backwards into the same .grad (accumulation), ordinary or split; returns (x grads, param grads)."""
    xg = []
    for s in range(steps):
        xt = Tensor(x[s], requires_grad=True)
        loss = (model(xt) ** 2).sum() * 0.5
        if split:
            w = backward_input(loss, inputs=[xt])
            xg.append(xt.grad.numpy().copy())
            assert all(q.grad is None for q in model.parameters()) or s > 0
            w.run()
        else:
            loss.backward()
            xg.append(xt.grad.numpy().copy())
    return xg, _grads(model)


def test_split_backward_is_bitwise_an_ordinary_backward_on_an_mlp():
    x = np.random.default_rng(1).standard_normal((2, 4, 5))
    ref_x, ref_p = _run(_mlp(), x, split=False)
    got_x, got_p = _run(_mlp(), x, split=True)
    for a, b in zip(ref_x, got_x):
        assert np.array_equal(a, b)
    assert ref_p.keys() == got_p.keys()
    for k in ref_p:
        assert np.array_equal(ref_p[k], got_p[k]), k


def test_input_pass_leaves_weights_untouched_and_w_fills_them():
    model = _mlp()
    xt = Tensor(np.ones((3, 5)), requires_grad=True)
    w = backward_input(model(xt).sum(), inputs=[xt])
    assert xt.grad is not None
    assert all(q.grad is None for q in model.parameters())
    w.run()
    assert all(q.grad is not None for q in model.parameters())
    with pytest.raises(RuntimeError, match="already"):
        w.run()


def test_split_backward_with_tied_weights_and_no_input_gradient():
    """A GPT stage 0 (token ids, no input gradient: everything is W) with tied embedding/head weights."""
    cfg = dict(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8, dropout=0.0)
    idx = np.random.default_rng(2).integers(0, 11, (2, 6))
    grads = []
    for split in (False, True):
        manual_seed(3)
        model = GPT(GPTConfig(**cfg), dtype=np.float64)
        logits, _ = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, 11), Tensor(idx.reshape(-1)))
        if split:
            w = backward_input(loss, inputs=[])
            assert all(q.grad is None for q in model.parameters())
            w.run()
        else:
            loss.backward()
        grads.append(_grads(model))
    for k in grads[0]:
        assert np.array_equal(grads[0][k], grads[1][k]), k


def test_post_accumulate_hooks_fire_in_w_for_weights():
    model = _mlp()
    fired = []
    for name, q in model.named_parameters():
        q.register_post_accumulate_grad_hook(lambda t, name=name: fired.append(name))
    xt = Tensor(np.ones((2, 5)), requires_grad=True)
    w = backward_input(model(xt).sum(), inputs=[xt])
    assert fired == []
    w.run()
    ref = []
    model2 = _mlp()
    for name, q in model2.named_parameters():
        q.register_post_accumulate_grad_hook(lambda t, name=name: ref.append(name))
    model2(Tensor(np.ones((2, 5)), requires_grad=True)).sum().backward()
    assert fired == ref


def test_backward_input_rejects_a_non_leaf_input():
    xt = Tensor(np.ones((2, 5)), requires_grad=True)
    h = xt * 2
    with pytest.raises(ValueError, match=r"inputs\[0\] must be a leaf"):
        backward_input(_mlp()(h).sum(), inputs=[h])


def test_checkpointed_chunk_runs_whole_in_b_and_is_not_counted_twice():
    x = np.random.default_rng(4).standard_normal((1, 3, 5))
    ref_x, ref_p = _run(_mlp(), x, split=False, steps=1)
    model = _mlp()
    xt = Tensor(x[0], requires_grad=True)
    loss = (nn.checkpoint(model, xt) ** 2).sum() * 0.5
    w = backward_input(loss, inputs=[xt])
    w.run()
    assert np.array_equal(xt.grad.numpy(), ref_x[0])
    for k, q in model.named_parameters():
        assert np.array_equal(q.grad.numpy(), ref_p[k]), k
