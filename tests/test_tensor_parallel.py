"""Megatron 1-D tensor parallelism: mappings in closed form, layers in float64 parity with the serial layers."""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.parallel.tensor import (
    ColumnParallelLinear, RowParallelLinear, TensorParallelAttention, TensorParallelMLP, VocabParallelEmbedding,
    copy_to_tensor_parallel_region, full_state_dict, gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region, sharded_state_dict,
    vocab_parallel_cross_entropy,
)

RTOL = 1e-12


def _world():
    return axonmpi.init()


def _groups():
    """The TP groups to test with at this world size: all ranks, and (at 4 ranks) pairs [0,1], [2,3]."""
    w = _world()
    out = [w.default_group]
    if w.world_size == 4:
        out.append(w.split(w.rank // 2, name="tp-pairs"))
    return out


def _close(a, b, rtol=RTOL):
    a, b = np.asarray(getattr(a, "data", a)), np.asarray(getattr(b, "data", b))
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(np.abs(b).max(), 1e-300)
    assert np.abs(a - b).max() <= rtol * scale, np.abs(a - b).max() / scale


def _rng(seed=0):
    return np.random.default_rng(seed)


def _sl(n, g):
    k = n // g.size
    return slice(g.rank * k, (g.rank + 1) * k)


# -- mappings --------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_mappings_forward_backward_closed_form():
    for g in _groups():
        p, r = g.size, g.rank
        x = Tensor(np.full((2, 3 * p), float(r + 1)), requires_grad=True)
        # copy_to: identity forward, all-reduce backward
        y = copy_to_tensor_parallel_region(x, g)
        _close(y, x)
        y.backward(Tensor(np.full(x.shape, float(r))))
        _close(x.grad, np.full(x.shape, p * (p - 1) / 2))
        # reduce_from: all-reduce forward, identity backward
        x.grad = None
        y = reduce_from_tensor_parallel_region(x, g)
        _close(y, np.full(x.shape, p * (p + 1) / 2))
        y.backward(Tensor(np.full(x.shape, 2.0)))
        _close(x.grad, np.full(x.shape, 2.0))
        # scatter_to / gather_from on the last dim
        full = Tensor(np.arange(6.0 * p).reshape(2, 3 * p), requires_grad=True)
        s = scatter_to_tensor_parallel_region(full, g)
        _close(s, full.data[:, 3 * r:3 * r + 3])
        gat = gather_from_tensor_parallel_region(s, g)
        _close(gat, full.data)
        gat.backward(Tensor(np.ones((2, 3 * p)) * (r + 1)))
        exp = np.zeros((2, 3 * p))
        exp[:, 3 * r:3 * r + 3] = r + 1       # split backward of gather, then gather backward of split
        _close(full.grad, np.concatenate([np.full((2, 3), q + 1.0) for q in range(p)], axis=1))
        # sequence pair on dim 0
        seq = Tensor(np.arange(4.0 * p * 2).reshape(4 * p, 2) * (r + 1), requires_grad=True)
        rs = reduce_scatter_to_sequence_parallel_region(seq, g)
        _close(rs, np.arange(4.0 * p * 2).reshape(4 * p, 2)[4 * r:4 * r + 4] * p * (p + 1) / 2)
        rs.backward(Tensor(np.full((4, 2), r + 1.0)))
        _close(seq.grad, np.concatenate([np.full((4, 2), q + 1.0) for q in range(p)]))
        loc = Tensor(np.full((2, 2), r + 1.0), requires_grad=True)
        ag = gather_from_sequence_parallel_region(loc, g)
        _close(ag, np.concatenate([np.full((2, 2), q + 1.0) for q in range(p)]))
        ag.backward(Tensor(np.ones((2 * p, 2))))
        _close(loc.grad, np.full((2, 2), float(p)))


@pytest.mark.mpi(min_size=1)
def test_group_of_one_returns_input_unchanged():
    w = _world()
    solo = w.split(w.rank, name="solo")
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    for fn in (copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region,
               scatter_to_tensor_parallel_region, gather_from_tensor_parallel_region,
               reduce_scatter_to_sequence_parallel_region, gather_from_sequence_parallel_region):
        assert fn(x, solo) is x


@pytest.mark.mpi(min_size=2)
def test_uneven_split_names_size_and_group():
    w = _world()
    x = Tensor(np.ones((2, 2 * w.world_size + 1)))
    with pytest.raises(ValueError, match=f"last dimension={2 * w.world_size + 1}.*size {w.world_size}"):
        scatter_to_tensor_parallel_region(x, w.default_group)
    with pytest.raises(ValueError, match=f"out_features=.*size {w.world_size}"):
        ColumnParallelLinear(4, w.world_size + 1, group=w.default_group)
    with pytest.raises(ValueError, match=f"in_features=.*size {w.world_size}"):
        RowParallelLinear(w.world_size + 1, 4, group=w.default_group)


# -- 1-D layers --------------------------------------------------------------------------------
def _serial_linear(i, o, bias, seed=3):
    axonmpi.random.manual_seed(seed)
    return nn.Linear(i, o, bias=bias, dtype="float64")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("gather_output", [True, False])
def test_column_parallel_linear_parity(bias, gather_output):
    for g in _groups():
        p = g.size
        ref = _serial_linear(5, 4 * p, bias)
        layer = ColumnParallelLinear(5, 4 * p, bias=bias, gather_output=gather_output, group=g, dtype="float64")
        layer.load_state_dict(ref.state_dict())
        X = _rng(1).standard_normal((3, 2, 5))
        G = _rng(2).standard_normal((3, 2, 4 * p))
        xs, xp_ = Tensor(X, requires_grad=True), Tensor(X.copy(), requires_grad=True)
        ys, yp = ref(xs), layer(xp_)
        cols = slice(None) if gather_output else _sl(4 * p, g)
        _close(yp, ys.data[..., cols])
        ys.backward(Tensor(G))
        yp.backward(Tensor(np.ascontiguousarray(G[..., cols])))
        _close(xp_.grad, xs.grad)
        _close(layer.weight.grad, ref.weight.grad.data[_sl(4 * p, g)])
        if bias:
            _close(layer.bias.grad, ref.bias.grad.data[_sl(4 * p, g)])
        sd = layer.state_dict(full=True)
        for k, v in ref.state_dict().items():
            _close(sd[k], v)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_parity(bias, input_is_parallel):
    for g in _groups():
        p = g.size
        ref = _serial_linear(3 * p, 4, bias)
        layer = RowParallelLinear(3 * p, 4, bias=bias, input_is_parallel=input_is_parallel, group=g,
                                  dtype="float64")
        layer.load_state_dict(ref.state_dict())
        X = _rng(1).standard_normal((2, 3, 3 * p))
        G = _rng(2).standard_normal((2, 3, 4))
        xs = Tensor(X, requires_grad=True)
        xin = X[..., _sl(3 * p, g)] if input_is_parallel else X
        xp_ = Tensor(np.ascontiguousarray(xin), requires_grad=True)
        ys, yp = ref(xs), layer(xp_)
        _close(yp, ys)
        ys.backward(Tensor(G))
        yp.backward(Tensor(G.copy()))
        _close(xp_.grad, xs.grad.data[..., _sl(3 * p, g)] if input_is_parallel else xs.grad)
        _close(layer.weight.grad, ref.weight.grad.data[:, _sl(3 * p, g)])
        if bias:
            _close(layer.bias.grad, ref.bias.grad)


@pytest.mark.mpi(min_size=1)
def test_vocab_parallel_embedding_and_cross_entropy_parity():
    for g in _groups():
        p = g.size
        V, D = 5 * p, 3
        axonmpi.random.manual_seed(5)
        ref = nn.Embedding(V, D, dtype="float64")
        emb = VocabParallelEmbedding(V, D, group=g, dtype="float64")
        emb.load_state_dict(ref.state_dict())
        ids = _rng(4).integers(0, V, (2, 6))
        hs, hp = ref(ids), emb(ids)
        _close(hp, hs)
        G = _rng(5).standard_normal((2, 6, D))
        hs.backward(Tensor(G))
        hp.backward(Tensor(G.copy()))
        _close(emb.weight.grad, ref.weight.grad.data[_sl(V, g)])
        # cross-entropy on vocab-split logits: loss and logits gradient
        logits = _rng(6).standard_normal((2, 6, V)) * 3
        ls = Tensor(logits, requires_grad=True)
        lp = Tensor(np.ascontiguousarray(logits[..., _sl(V, g)]), requires_grad=True)
        for red in ("mean", "sum"):
            ls.grad = lp.grad = None
            a = F.cross_entropy(ls, ids, reduction=red)
            b = vocab_parallel_cross_entropy(lp, ids, g, reduction=red)
            _close(b, a)
            a.backward()
            b.backward()
            _close(lp.grad, ls.grad.data[..., _sl(V, g)])


@pytest.mark.mpi(min_size=1)
def test_vocab_parallel_cross_entropy_ignore_index_and_label_smoothing():
    """Issue 21: -100 targets counted as "not mine" everywhere and added log-sum-exp; now they are
    ignored as F.cross_entropy (torch) ignores them, and label_smoothing matches torch's too."""
    for g in _groups():
        V = 3 * g.size
        logits = _rng(9).standard_normal((3, 4, V)) * 2
        ids = _rng(10).integers(0, V, (3, 4))
        ids[0, :3] = -100
        ids[2, 1] = -100                           # 4 of 12 targets ignored, unevenly over rows
        for eps in (0.0, 0.1):
            for red in ("mean", "sum", "none"):
                ls = Tensor(logits, requires_grad=True)
                lp = Tensor(np.ascontiguousarray(logits[..., _sl(V, g)]), requires_grad=True)
                a = F.cross_entropy(ls, ids, reduction=red, label_smoothing=eps)
                b = vocab_parallel_cross_entropy(lp, ids, g, reduction=red, label_smoothing=eps)
                _close(b, a, 1e-10)
                (a if red != "none" else a.sum()).backward()
                (b if red != "none" else b.sum()).backward()
                _close(lp.grad, ls.grad.data[..., _sl(V, g)], 1e-10)
        lp = Tensor(np.ascontiguousarray(logits[..., _sl(V, g)]), requires_grad=True)
        loss = vocab_parallel_cross_entropy(lp, np.full((3, 4), -100), g)
        loss.backward()
        assert np.isnan(loss.item()) and not lp.grad.data.any()   # torch: nan loss, zero gradient
        rank = g.world.rank
        for bad in (-1, V):
            t = ids.copy()
            t[1, 2] = bad
            with pytest.raises(IndexError, match=f"rank {rank}: vocab_parallel_cross_entropy: target {bad} "
                                                 f"is out of bounds for {V} classes"):
                vocab_parallel_cross_entropy(lp, t, g)


@pytest.mark.mpi(min_size=1)
def test_vocab_parallel_cross_entropy_in_a_captured_step_reads_nothing_and_equals_eager():
    """In a captured step (as on a GPU) the target check, the mean's count and the backward's row pick are array
    ops: no host read; the loss and gradient equal the eager ones bit for bit; a bad target gives a NaN loss."""
    from axonmpi.autograd.replay import RECORD, Tape, use_tape
    from axonmpi.graphs.count import CountedArray, counting
    for g in _groups():
        V = 3 * g.size
        logits = _rng(11).standard_normal((2, 5, V))
        ids = _rng(12).integers(0, V, (2, 5))
        ids[1, :2] = -100
        for eps in (0.0, 0.1):
            for red in ("mean", "sum", "none"):
                out = []
                for captured in (False, True):
                    lp = Tensor(np.ascontiguousarray(logits[..., _sl(V, g)]), requires_grad=True)
                    with counting() as c:
                        if captured:
                            with use_tape(Tape(), RECORD):
                                loss = vocab_parallel_cross_entropy(lp, ids.view(CountedArray), g, reduction=red,
                                                                    label_smoothing=eps)
                                (loss if red != "none" else loss.sum()).backward()
                            assert c.host_syncs == 0, dict(c.syncs)
                        else:
                            loss = vocab_parallel_cross_entropy(lp, ids, g, reduction=red, label_smoothing=eps)
                            (loss if red != "none" else loss.sum()).backward()
                    out.append((np.asarray(loss.data).copy(), lp.grad.data.copy()))
                np.testing.assert_array_equal(out[0][0], out[1][0])
                np.testing.assert_array_equal(out[0][1], out[1][1])
        t = ids.copy()
        t[0, 3] = V
        lp = Tensor(np.ascontiguousarray(logits[..., _sl(V, g)]), requires_grad=True)
        with use_tape(Tape(), RECORD):
            loss = vocab_parallel_cross_entropy(lp, t, g)
        assert np.isnan(loss.item())
        with use_tape(Tape(), RECORD):
            loss = vocab_parallel_cross_entropy(lp, np.full((2, 5), -100), g)
        assert np.isnan(loss.item())


@pytest.mark.mpi(min_size=2)
def test_vocab_parallel_cross_entropy_refuses_uneven_shards():
    """V = 2P+1 split 3,2,2,...: start = rank * width was silently wrong (rel. error ~0.2)."""
    g = _world().default_group
    width = 3 if g.rank == 0 else 2
    lp = Tensor(np.zeros((2, width)), requires_grad=True)
    with pytest.raises(ValueError, match=rf"rank {g.world.rank}: vocab_parallel_cross_entropy needs equal "
                                         rf"vocabulary shards, got widths from 2 to 3 .*this rank: {width}.*pad"):
        vocab_parallel_cross_entropy(lp, np.array([0, 1]), g)


@pytest.mark.mpi(min_size=1)
def test_mlp_and_attention_parity_and_state_roundtrip():
    for g in _groups():
        p = g.size
        axonmpi.random.manual_seed(11)
        ref_mlp = nn.MLP(4 * p, dtype="float64")
        ref_att = nn.CausalSelfAttention(4 * p, 2 * p, dtype="float64")
        mlp = TensorParallelMLP(4 * p, group=g, dtype="float64")
        att = TensorParallelAttention(4 * p, 2 * p, group=g, dtype="float64")
        mlp.load_state_dict(ref_mlp.state_dict(), strict=False)
        att.load_state_dict(ref_att.state_dict(), strict=False)
        X = _rng(7).standard_normal((2, 5, 4 * p))
        G = _rng(8).standard_normal((2, 5, 4 * p))
        for ref, tp in ((ref_mlp, mlp), (ref_att, att)):
            xs, xt = Tensor(X, requires_grad=True), Tensor(X.copy(), requires_grad=True)
            ys, yt = ref(xs), tp(xt)
            _close(yt, ys)
            ys.backward(Tensor(G))
            yt.backward(Tensor(G.copy()))
            _close(xt.grad, xs.grad)
            full_grads = full_state_dict(tp, grads=True)
            for k, v in ref.named_parameters():
                _close(full_grads[k], v.grad)
            sd = full_state_dict(tp)
            for k, v in ref.state_dict().items():
                _close(sd[k], v)
            blocks = sharded_state_dict(tp)
            for k, b in blocks.items():
                if hasattr(b, "global_shape"):
                    assert b.global_shape == ref.state_dict()[k].shape
                    idx = tuple(slice(o, o + s) for o, s in zip(b.offsets, b.local.shape))
                    _close(b.local, ref.state_dict()[k][idx])


@pytest.mark.mpi(min_size=1)
def test_tp_layers_cast_with_double_and_to():
    g = _world().default_group
    layer = ColumnParallelLinear(3, 2 * g.size, group=g)
    assert layer.weight.dtype == np.float32
    layer.double()
    assert layer.weight.dtype == np.float64 and layer.bias.dtype == np.float64
    layer.to(dtype=np.float32)
    assert layer.weight.dtype == np.float32


@pytest.mark.mpi(min_size=1)
def test_attention_dropout_matches_serial_masks_under_a_fixed_seed():
    for g in _groups():
        p = g.size
        axonmpi.random.manual_seed(12)
        ref = nn.CausalSelfAttention(4 * p, 2 * p, dropout=0.3, dtype="float64")
        att = TensorParallelAttention(4 * p, 2 * p, group=g, dropout=0.3, dtype="float64")
        att.load_state_dict(ref.state_dict())
        X = _rng(3).standard_normal((2, 5, 4 * p))
        xs, xt = Tensor(X, requires_grad=True), Tensor(X.copy(), requires_grad=True)
        axonmpi.random.manual_seed(99)
        ys = ref(xs)
        axonmpi.random.manual_seed(99)
        yt = att(xt)
        _close(yt, ys)
        assert (ys.data == 0).any()            # dropout did act
        ys.sum().backward()
        yt.sum().backward()
        _close(xt.grad, xs.grad)
        grads = full_state_dict(att, grads=True)
        for k, v in ref.named_parameters():
            _close(grads[k], v.grad)


@pytest.mark.mpi(min_size=1)
def test_vocab_parallel_embedding_keeps_padding_idx():
    """Issue 21: the GPT's vocabulary-parallel ``wte`` dropped padding_idx, so the padding row got gradients
    (rel. error 1.05)."""
    for g in _groups():
        V, D = 4 * g.size, 3
        pad = V - 2                                    # owned by the group's last rank
        axonmpi.random.manual_seed(3)
        ref = nn.Embedding(V, D, padding_idx=pad, dtype="float64")
        emb = VocabParallelEmbedding(V, D, group=g, dtype="float64", padding_idx=pad)
        assert emb.padding_idx == pad and emb.state_dict(full=True)["weight"][pad].tolist() == [0.0] * D
        emb.load_state_dict(ref.state_dict())
        ids = np.array([[pad, 0, pad, V - 1], [1, pad, 2, 0]])
        G = _rng(12).standard_normal((2, 4, D))
        ref(ids).backward(Tensor(G))
        emb(ids).backward(Tensor(G.copy()))
        full = ref.weight.grad.data
        assert not full[pad].any()
        _close(emb.weight.grad, full[_sl(V, g)], 1e-12)


@pytest.mark.mpi(min_size=1)
def test_parallelize_vocab_plan_keeps_padding_idx():
    """The GPT's ``wte`` under ``parallelize``'s ``"vocab"`` plan keeps padding_idx: no gradient in that row."""
    from axonmpi.models import GPT, GPTConfig
    from axonmpi.parallel import parallelize
    from axonmpi.recipes.gpt import gpt_plan
    world = _world()
    p = world.world_size
    V = 4 * p
    pad = V - 2                                        # owned by the last rank
    ids = np.array([[pad, 0, pad, V - 1], [1, pad, 2, 0]])
    cfg = GPTConfig(vocab_size=V, block_size=4, n_layer=1, n_head=p, n_embd=2 * p)
    model = GPT(cfg, dtype="float64")
    model.wte = nn.Embedding(V, 2 * p, padding_idx=pad, dtype="float64")
    grid = axonmpi.ProcessGrid(world, G_intra_c=p)
    try:
        pm = parallelize(model, grid=grid, tensor_parallel=gpt_plan(cfg, sequence_parallel=True),
                         data_parallel=None)           # wte "vocab", lm_head "column_gather"
        assert isinstance(model.wte, VocabParallelEmbedding) and model.wte.padding_idx == pad
        _, loss = pm(ids, ids[:, ::-1].copy())
        loss.backward()
        if grid.intra_group.rank == p - 1:             # the owner: no gradient in the padding row
            assert not model.wte.weight.grad.data[pad - model.wte.vocab_start].any()
    finally:
        grid.free()
