"""issue 48 item 5: the torch names well-known model files call — ``topk``, ``multinomial``, ``tril`` / ``triu``,
``torch.utils.checkpoint``, the float32 matmul precision switches, and the rank variables ``init_process_group``
publishes — with values against torch where it is installed, and nanoGPT's ``generate(top_k=...)`` idiom."""
import os

import numpy as np
import pytest

import axonmpi
import axonmpi as torch_like          # the import rule: `import torch` becomes `import axonmpi as torch`
from axonmpi import Tensor, nn
import axonmpi.nn.functional as F

RNG = np.random.default_rng(48)


def _x(*shape):
    return Tensor(RNG.standard_normal(shape), requires_grad=True, dtype=np.float64)


@pytest.mark.serial
@pytest.mark.parametrize("k,dim,largest,sorted_", [(3, -1, True, True), (1, 0, True, True), (2, 1, False, True),
                                                  (4, -1, True, False), (0, -1, True, True)])
def test_topk_matches_torch(k, dim, largest, sorted_):
    torch = pytest.importorskip("torch")
    a = RNG.standard_normal((3, 4, 5))
    v, i = axonmpi.topk(Tensor(a), k, dim=dim, largest=largest, sorted=sorted_)
    tv, ti = torch.topk(torch.tensor(a), k, dim=dim, largest=largest, sorted=sorted_)
    if not sorted_:            # torch leaves the order free: compare as sets along dim
        v, tv = np.sort(v.numpy(), axis=dim), np.sort(tv.numpy(), axis=dim)
        assert np.array_equal(v, tv)
        return
    assert np.array_equal(v.numpy(), tv.numpy()) and np.array_equal(i.numpy(), ti.numpy())
    assert i.dtype == np.int64


@pytest.mark.serial
def test_topk_returns_a_named_pair_and_its_values_carry_the_gradient():
    x = _x(2, 6)
    out = x.topk(2)
    assert out.values is out[0] and out.indices is out[1]
    (out.values * Tensor(np.array([[1.0, 2.0], [3.0, 4.0]]))).sum().backward()
    expect = np.zeros((2, 6))
    idx = np.argsort(-x.data, axis=1)[:, :2]
    np.put_along_axis(expect, idx, np.array([[1.0, 2.0], [3.0, 4.0]]), axis=1)
    assert np.array_equal(x.grad.numpy(), expect)


@pytest.mark.serial
def test_topk_refuses_k_out_of_range_naming_the_size():
    with pytest.raises(ValueError, match=r"k must be an int in \[0, 5\]"):
        axonmpi.topk(Tensor(np.zeros((2, 5))), 6)


@pytest.mark.serial
@pytest.mark.parametrize("name,diagonal", [("tril", 0), ("tril", -1), ("triu", 1), ("triu", -2)])
def test_tril_triu_match_torch_as_functions_and_methods(name, diagonal):
    a = RNG.standard_normal((2, 4, 5))
    ours_fn = getattr(axonmpi, name)(Tensor(a), diagonal=diagonal).numpy()
    ours_m = getattr(Tensor(a), name)(diagonal).numpy()
    ref = (np.triu if name == "triu" else np.tril)(a, diagonal)
    assert np.array_equal(ours_fn, ref) and np.array_equal(ours_m, ref)
    torch = pytest.importorskip("torch")
    assert np.array_equal(ours_fn, getattr(torch, name)(torch.tensor(a), diagonal=diagonal).numpy())


@pytest.mark.serial
def test_tril_mask_as_nanogpt_builds_it():
    mask = axonmpi.tril(axonmpi.ones(4, 4)).view(1, 1, 4, 4)
    att = Tensor(np.zeros((1, 1, 4, 4)))
    att = att.masked_fill(mask[:, :, :4, :4] == 0, float("-inf"))
    assert np.isneginf(att.numpy()[0, 0, 0, 1]) and att.numpy()[0, 0, 1, 0] == 0


@pytest.mark.serial
def test_multinomial_frequencies_with_and_without_replacement():
    p = np.array([[0.1, 0.2, 0.7], [0.5, 0.5, 0.0]])
    g = axonmpi.Generator().manual_seed(0)
    draws = axonmpi.multinomial(Tensor(p), 4000, replacement=True, generator=g).numpy()
    assert draws.shape == (2, 4000) and draws.dtype == np.int64
    freq = np.stack([np.bincount(r, minlength=3) / 4000 for r in draws])
    assert np.allclose(freq, p, atol=0.03)
    once = Tensor(np.array([1.0, 5.0, 0.0, 2.0])).multinomial(3)           # unnormalised weights, no zero drawn
    assert sorted(once.tolist()) == [0, 1, 3]


@pytest.mark.serial
def test_multinomial_is_reproducible_from_a_generator_and_the_default_seed():
    p = Tensor(np.full((3, 10), 0.1))
    a = axonmpi.multinomial(p, 2, generator=axonmpi.Generator().manual_seed(7)).numpy()
    b = axonmpi.multinomial(p, 2, generator=axonmpi.Generator().manual_seed(7)).numpy()
    axonmpi.manual_seed(1)
    c = axonmpi.multinomial(p, 1).numpy()
    axonmpi.manual_seed(1)
    d = axonmpi.multinomial(p, 1).numpy()
    assert np.array_equal(a, b) and np.array_equal(c, d)


@pytest.mark.serial
@pytest.mark.parametrize("weights,n,repl,match", [
    (np.array([0.5, -0.1, 0.6]), 1, False, "non-negative"),
    (np.array([0.0, 0.0]), 1, True, "sums to 0"),
    (np.array([0.3, 0.7]), 3, False, "without replacement"),
    (np.array([0.0, 1.0, 0.0]), 2, False, "fewer than 2 non-zero"),
    (np.zeros((1, 1, 2)) + 1, 1, True, "1-d or 2-d"),
])
def test_multinomial_refuses_what_torch_refuses(weights, n, repl, match):
    with pytest.raises(ValueError, match=match):
        axonmpi.multinomial(Tensor(weights), n, replacement=repl)


class _TinyLM(nn.Module):
    """Returns (logits, loss) as nanoGPT's GPT does."""

    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx, targets=None):
        return self.head(self.wte(idx)), None


@axonmpi.no_grad()
def _generate(model, idx, max_new_tokens, temperature=1.0, top_k=None):
    """nanoGPT's GPT.generate, line for line under the import rule."""
    torch = torch_like
    for _ in range(max_new_tokens):
        idx_cond = idx if idx.size(1) <= 16 else idx[:, -16:]
        logits, _ = model(idx_cond)
        logits = logits[:, -1, :] / temperature
        if top_k is not None:
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float('Inf')
        probs = F.softmax(logits, dim=-1)
        idx_next = torch.multinomial(probs, num_samples=1)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


@pytest.mark.serial
def test_nanogpt_generate_with_top_k_runs_and_draws_only_top_k_tokens():
    axonmpi.manual_seed(0)
    model = _TinyLM()
    idx = axonmpi.tensor(np.zeros((2, 1), np.int64))
    out = _generate(model, idx, 6, top_k=1)          # top_k=1: greedy, so each token is the argmax
    assert tuple(out.shape) == (2, 7) and out.dtype == np.int64
    for t in range(1, 7):
        logits, _ = model(out[:, :t])
        assert np.array_equal(out.numpy()[:, t], logits.numpy()[:, -1].argmax(-1))
    assert tuple(_generate(model, idx, 3, top_k=4).shape) == (2, 4)


@pytest.mark.serial
def test_utils_checkpoint_gradients_equal_an_unchecked_call():
    from axonmpi.utils.checkpoint import checkpoint, checkpoint_sequential
    axonmpi.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).to(dtype=np.float64)
    x = _x(3, 4)
    block(x).sum().backward()
    ref = [p.grad.numpy().copy() for p in block.parameters()] + [x.grad.numpy().copy()]
    for reentrant in (True, False, None):
        block.zero_grad()
        x.grad = None
        checkpoint(block, x, use_reentrant=reentrant).sum().backward()
        got = [p.grad.numpy() for p in block.parameters()] + [x.grad.numpy()]
        assert all(np.array_equal(a, b) for a, b in zip(ref, got))
    block.zero_grad()
    checkpoint_sequential(block, 2, x, use_reentrant=False).sum().backward()
    assert np.array_equal(block[0].weight.grad.numpy(), ref[0])
    scaled = checkpoint(lambda t, scale: t * scale, x, scale=2.0, use_reentrant=False)
    assert np.array_equal(scaled.numpy(), 2 * x.numpy())
    with pytest.raises(NotImplementedError, match="context_fn"):
        checkpoint(block, x, context_fn=lambda: None)


@pytest.mark.serial
def test_float32_matmul_precision_and_tf32_switches():
    torch = torch_like
    before = torch.get_float32_matmul_precision()
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
        torch.set_float32_matmul_precision("highest")
        assert not torch.backends.cuda.matmul.allow_tf32
        with pytest.raises(ValueError, match="highest"):
            torch.set_float32_matmul_precision("fast")
        with pytest.raises(AttributeError, match="allow_tf32"):
            torch.backends.cuda.matmul.allow_fp16_reduced_precision = True
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.mpi(min_size=1)
def test_init_process_group_publishes_rank_variables():
    import axonmpi.distributed as dist
    from axonmpi.distributed import rank_env
    from axonmpi.distributed import world as _world
    if not (dist.is_initialized() and getattr(_world._WORLD, "_from_process_group", False)):
        for name in rank_env.RANK_VARS:       # as a fresh launch: the variables come from init_process_group
            os.environ.pop(name, None)
        dist.init_process_group("gloo")
    w = axonmpi.distributed.get_world()
    want = rank_env.rank_variables(w)
    assert {k: os.environ[k] for k in rank_env.RANK_VARS} == want
    assert os.environ["RANK"] == str(w.rank) == want["RANK"]
    assert os.environ["WORLD_SIZE"] == str(w.world_size)
    assert os.environ["LOCAL_RANK"] == str(w.local_rank) and "MASTER_ADDR" in os.environ
    saved = os.environ["RANK"]
    os.environ["RANK"] = str(w.rank + 1)
    try:
        with pytest.raises(ValueError, match=rf"RANK='{w.rank + 1}'.*RANK={w.rank}"):
            rank_env.publish_rank_env(w)
    finally:
        os.environ["RANK"] = saved


@pytest.mark.serial
def test_the_launchers_variables_give_torchruns():
    from axonmpi.distributed.rank_env import launcher_variables
    hydra = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert launcher_variables(hydra) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    ompi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert launcher_variables(ompi)["WORLD_SIZE"] == "2"
    assert launcher_variables({"PMI_RANK": "0"}) == {}          # part of them: nothing


@pytest.mark.serial
def test_a_tensor_indexes_a_memmap_window_as_nanogpt_draws_it(tmp_path):
    np.arange(40, dtype=np.uint16).tofile(tmp_path / "t.bin")
    data = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")
    ix = torch_like.randint(len(data) - 8, (3,))
    x = torch_like.stack([torch_like.from_numpy((data[i:i + 8]).astype(np.int64)) for i in ix])
    assert tuple(x.shape) == (3, 8) and all(x.numpy()[k, 0] == int(ix[k]) for k in range(3))
    with pytest.raises(TypeError, match="integer tensors of a single element"):
        data[Tensor(np.array(1.5)):]


@pytest.mark.mpi(min_size=1)
def test_ddp_require_backward_grad_sync_as_nanogpt_sets_it(world):
    """``model.require_backward_grad_sync = False`` for all micro-steps but the last: the accumulated local sum is
    reduced once, as torch's DDP does."""
    from axonmpi.parallel import DistributedDataParallel as DDP
    axonmpi.manual_seed(0)
    m = DDP(nn.Linear(3, 2, dtype=np.float64))
    x = np.random.default_rng(world.rank).standard_normal((4, 3))
    m.require_backward_grad_sync = False
    m(x).sum().backward()
    local = m.module.weight.grad.numpy().copy()
    m.require_backward_grad_sync = True
    m(x).sum().backward()
    want = axonmpi.all_reduce_sum(2 * local) / world.world_size
    np.testing.assert_allclose(m.module.weight.grad.numpy(), want, rtol=1e-12)
    assert m.require_backward_grad_sync


@pytest.mark.serial
def test_tf32_switch_sets_cupys_float32_compute_type(monkeypatch):
    """On a GPU the switch is CuPy's compute type for float32 GEMMs (7: TF32, 1: default) and ``CUPY_TF32`` for a
    CuPy imported later; checked here with a stand-in module recording the calls (no GPU on the test host)."""
    import sys
    import types
    calls = []
    linalg = types.SimpleNamespace(set_compute_type=lambda dt, ct: calls.append((np.dtype(dt), ct)))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(_core=types.SimpleNamespace(_routines_linalg=linalg)))
    monkeypatch.setenv("CUPY_TF32", "0")
    before = torch_like.get_float32_matmul_precision()
    try:
        torch_like.backends.cuda.matmul.allow_tf32 = True
        assert calls[-1] == (np.dtype(np.float32), 7) and os.environ["CUPY_TF32"] == "1"
        torch_like.set_float32_matmul_precision("highest")
        assert calls[-1] == (np.dtype(np.float32), 1) and os.environ["CUPY_TF32"] == "0"
    finally:
        torch_like.set_float32_matmul_precision(before)
