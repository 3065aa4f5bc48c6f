"""Activation checkpointing: exact gradients (finite differences in float64), same dropout masks, less memory."""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
from axonmpi import Tensor, gradcheck
from axonmpi.parallel.pipeline.runtime import _graph_bytes


def _block(dropout=0.0):
    axonmpi.random.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 6, dtype=np.float64), nn.GELU(), nn.Dropout(dropout),
                         nn.Linear(6, 4, dtype=np.float64), nn.Tanh())


def test_checkpoint_gradcheck_inputs():
    block = _block()
    x = Tensor(np.random.default_rng(0).standard_normal((3, 4)), requires_grad=True)
    assert gradcheck(lambda t: nn.checkpoint(block, t), [x])


def test_checkpoint_gradcheck_parameters():
    block = _block()
    w = block[0].weight
    x = Tensor(np.random.default_rng(1).standard_normal((3, 4)))    # no input needs grad
    assert gradcheck(lambda _w: nn.checkpoint(block, x), [w])


def test_checkpoint_gradients_equal_plain_run_with_dropout():
    x0 = np.random.default_rng(2).standard_normal((5, 4))
    grads = []
    for use_ckpt in (False, True):
        block = _block(dropout=0.5)
        axonmpi.random.manual_seed(99)
        x = Tensor(x0.copy(), requires_grad=True)
        y = nn.checkpoint(block, x) if use_ckpt else block(x)
        (y * y).sum().backward()
        after = axonmpi.random.default_generator().random()
        grads.append([x.grad.numpy()] + [q.grad.numpy() for q in block.parameters()] + [y.numpy(), after])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)    # same masks, same order of operations: bit-identical


def test_without_preserve_rng_state_masks_differ():
    block = _block(dropout=0.5)
    x = Tensor(np.ones((8, 4)), requires_grad=True)
    axonmpi.random.manual_seed(1)
    y = nn.checkpoint(block, x, preserve_rng_state=False)
    y.sum().backward()
    g_plain = x.grad.numpy()
    block2 = _block(dropout=0.5)
    axonmpi.random.manual_seed(1)
    x2 = Tensor(np.ones((8, 4)), requires_grad=True)
    block2(x2).sum().backward()
    assert not np.allclose(g_plain, x2.grad.numpy())


def test_checkpoint_sequential_matches_and_saves_memory():
    axonmpi.random.manual_seed(4)
    layers = [nn.Linear(8, 8, dtype=np.float64) if k % 2 == 0 else nn.GELU() for k in range(8)]
    model = nn.Sequential(*layers)
    x0 = np.random.default_rng(5).standard_normal((16, 8))
    outs, grads, saved = [], [], []
    for segments in (None, 1, 2, 4):
        model.zero_grad()
        x = Tensor(x0.copy(), requires_grad=True)
        y = model(x) if segments is None else nn.checkpoint_sequential(model, segments, x)
        saved.append(_graph_bytes([y], {id(q.data) for q in model.parameters()}))
        y.sum().backward()
        outs.append(y.numpy())
        grads.append([x.grad.numpy()] + [q.grad.numpy() for q in model.parameters()])
    for k in range(1, 4):
        np.testing.assert_allclose(outs[k], outs[0], rtol=1e-14)
        for a, b in zip(grads[k], grads[0]):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)
    # the plain run keeps every intermediate; 4 segments keep the 3 boundaries + the last segment's
    assert saved[3] < saved[0] and saved[2] < saved[0]


def test_checkpoint_under_no_grad_is_a_plain_call():
    block = _block()
    with axonmpi.no_grad():
        y = nn.checkpoint(block, Tensor(np.ones((2, 4))))
    assert y.grad_fn is None


def test_checkpoint_sequential_errors():
    with pytest.raises(ValueError, match=r"segments must be an int in \[1, 2\] for 2 modules, got 3"):
        nn.checkpoint_sequential([nn.ReLU(), nn.ReLU()], 3, Tensor(np.ones(2)))
    with pytest.raises(TypeError, match="fn must be callable"):
        nn.checkpoint(3, Tensor(np.ones(2)))
