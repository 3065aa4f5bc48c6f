"""Datasets, DataLoader ordering/batching and the stdlib corpus tools."""
import math

import numpy as np
import pytest

from axonmpi.data import (
    CharDataset,
    CharTokenizer,
    DataLoader,
    Dataset,
    DistributedSampler,
    Subset,
    TensorDataset,
    default_collate,
    load_stdlib_corpus,
    unigram_entropy,
)


class _ListDataset(Dataset):
    """A dataset without a get_batch fast path (per-sample collation)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": np.full(3, float(i)), "y": i}


def _seen(loader):
    return np.concatenate([b[0] for b in loader]).tolist()


# ---------------------------------------------------------------- datasets

def test_tensor_dataset_rows_and_errors():
    x, y = np.arange(12.0).reshape(6, 2), np.arange(6) * 10
    ds = TensorDataset(x, y)
    assert len(ds) == 6
    xi, yi = ds[-1]
    np.testing.assert_array_equal(xi, x[5])
    assert yi == 50
    with pytest.raises(IndexError, match="6"):
        ds[6]
    with pytest.raises(ValueError, match=r"\[6, 5\]"):
        TensorDataset(x, y[:5])


def test_subset_maps_indices_and_keeps_fast_path():
    ds = TensorDataset(np.arange(10) * 2)
    sub = Subset(ds, [7, 3, -1])
    assert len(sub) == 3 and sub[1] == (6,) and sub[2] == (18,)
    np.testing.assert_array_equal(sub.get_batch(np.array([2, 0]))[0], [18, 14])
    assert not hasattr(Subset(_ListDataset(5), [1]), "get_batch")
    with pytest.raises(IndexError):
        Subset(ds, [10])


# ---------------------------------------------------------------- loader

@pytest.mark.parametrize("n,bs", [(10, 3), (9, 3), (1, 4)])
def test_every_sample_once_per_epoch(n, bs):
    dl = DataLoader(TensorDataset(np.arange(n)), batch_size=bs, shuffle=True, seed=5)
    for _ in range(3):
        seen = _seen(dl)
        assert sorted(seen) == list(range(n))
    assert len(dl) == math.ceil(n / bs)


def test_shuffle_is_deterministic_and_changes_with_epoch():
    ds = TensorDataset(np.arange(50))
    a = DataLoader(ds, batch_size=7, shuffle=True, seed=1)
    b = DataLoader(ds, batch_size=7, shuffle=True, seed=1)
    a0, a1 = _seen(a), _seen(a)  # epoch auto-advances after each pass
    b.set_epoch(1)
    assert _seen(b) == a1
    b.set_epoch(0)
    assert _seen(b) == a0
    assert a0 != a1 and a0 != list(range(50))
    assert _seen(DataLoader(ds, batch_size=7, shuffle=True, seed=2)) != a0
    assert _seen(DataLoader(ds, batch_size=7)) == list(range(50))


def test_drop_last():
    dl = DataLoader(TensorDataset(np.arange(10)), batch_size=4, drop_last=True, shuffle=True)
    batches = list(dl)
    assert len(dl) == len(batches) == 2
    assert all(b[0].shape == (4,) for b in batches)
    assert len(set(np.concatenate([b[0] for b in batches]).tolist())) == 8


def test_tensor_dataset_fast_path_equals_indexed_arrays():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((23, 4, 2)).astype(np.float32)
    y = rng.integers(0, 5, 23)
    dl = DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True, seed=3)
    dl_slow = DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True, seed=3, collate_fn=default_collate)
    order = np.random.default_rng((3, 0)).permutation(23)
    for k, ((bx, by), (sx, sy)) in enumerate(zip(dl, dl_slow)):
        idx = order[5 * k:5 * k + 5]
        np.testing.assert_array_equal(bx, x[idx])
        np.testing.assert_array_equal(by, y[idx])
        np.testing.assert_array_equal(sx, bx)
        np.testing.assert_array_equal(sy, by)
        assert bx.dtype == np.float32 and by.dtype == y.dtype
    assert bx.shape == (3, 4, 2)


def test_default_collate_dicts_tuples_numbers():
    batch = next(iter(DataLoader(_ListDataset(5), batch_size=4)))
    assert batch["x"].shape == (4, 3)
    np.testing.assert_array_equal(batch["y"], [0, 1, 2, 3])
    assert default_collate([("a", 1.5), ("b", 2.5)]) == (["a", "b"], pytest.approx(np.array([1.5, 2.5])))


class _Sampler:
    def __init__(self, idx):
        self.idx, self.epoch = idx, None

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)

    def set_epoch(self, e):
        self.epoch = e


def test_sampler_order_and_set_epoch_pass_through():
    s = _Sampler([4, 0, 2])
    dl = DataLoader(TensorDataset(np.arange(5) * 10), batch_size=2, sampler=s)
    assert len(dl) == 2
    assert _seen(dl) == [40, 0, 20]
    dl.set_epoch(7)
    assert s.epoch == 7
    with pytest.raises(ValueError, match="sampler"):
        DataLoader(TensorDataset(np.arange(5)), shuffle=True, sampler=s)


# ---------------------------------------------------------------- DistributedSampler (PyTorch's rules)

# Printed by torch 2.13's torch.utils.data.DistributedSampler(range(n), num_replicas, rank, shuffle=False,
# drop_last) for every rank: padding repeats the head, drop_last trims the tail, rank r strides from r.
TORCH_LISTS = {
    (10, 4, False): [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]],
    (10, 4, True): [[0, 4], [1, 5], [2, 6], [3, 7]],
    (2, 5, False): [[0], [1], [0], [1], [0]],          # padding longer than the dataset
    (3, 4, False): [[0], [1], [2], [0]],
    (10, 2, True): [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]],
    (10, 3, True): [[0, 3, 6], [1, 4, 7], [2, 5, 8]],
    (7, 3, False): [[0, 3, 6], [1, 4, 0], [2, 5, 1]],
}


@pytest.mark.parametrize("n,replicas,drop_last", sorted(TORCH_LISTS))
def test_distributed_sampler_matches_torch_lists(n, replicas, drop_last):
    want = TORCH_LISTS[(n, replicas, drop_last)]
    for r in range(replicas):
        s = DistributedSampler(range(n), num_replicas=replicas, rank=r, shuffle=False, drop_last=drop_last)
        assert list(s) == want[r] and len(s) == len(want[r])
        # shuffled: the same padding/stride applied to the epoch's permutation
        t = DistributedSampler(range(n), num_replicas=replicas, rank=r, shuffle=True, seed=5, drop_last=drop_last)
        t.set_epoch(3)
        perm = np.random.default_rng((5, 3)).permutation(n)
        assert list(t) == perm[want[r]].tolist()


def _replicas(n_items, n, state=None, seed=2):
    samplers = [DistributedSampler(range(n_items), num_replicas=n, rank=r, seed=seed) for r in range(n)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    return samplers


def _run(samplers, global_batch, steps, n_items):
    """train_gpt.py's loop for all replicas in lockstep; returns each step's global batch and the state."""
    n = len(samplers)
    ds = TensorDataset(np.arange(n_items))
    loaders = [DataLoader(ds, batch_size=global_batch // n, sampler=s, drop_last=True) for s in samplers]
    its, out = [None] * n, []
    while len(out) < steps:
        if its[0] is None:
            its = [iter(dl) for dl in loaders]
        try:
            batches = [next(it)[0] for it in its]
        except StopIteration:
            for s in samplers:
                s.set_epoch(s.epoch + 1)
            its = [None] * n
            continue
        for s, b in zip(samplers, batches):
            s.advance(len(b))
        out.append(np.concatenate(batches).tolist())
    states = [s.state_dict() for s in samplers]
    assert all(st == states[0] for st in states)
    return out, states[0]


def test_sampler_resume_keeps_counting_after_a_resume():
    """Save at 8 consumed, resume, consume 2 more per replica: the state says 12 (was 4 before the fix)."""
    s = DistributedSampler(range(40), num_replicas=2, rank=0, seed=1)
    s.advance(4)
    st = s.state_dict()
    assert st["consumed_global"] == 8
    t = DistributedSampler(range(40), num_replicas=2, rank=0, seed=1)
    t.load_state_dict(st)
    first = list(t)                      # the pass starts after the consumed samples...
    assert first == s.indices()[4:].tolist() and t.consumed == 4
    t.advance(2)                         # ...and does not forget them
    assert t.state_dict() == {"epoch": 0, "seed": 1, "consumed_global": 12}
    u = DistributedSampler(range(40), num_replicas=2, rank=0, seed=1)
    u.load_state_dict(t.state_dict())
    assert list(u) == s.indices()[6:].tolist()


def test_sampler_resumed_three_times_with_changing_world_size_equals_uninterrupted():
    n_items, gb = 100, 12
    want, want_state = _run(_replicas(n_items, 2), gb, 8, n_items)
    got, state = [], None
    for n, steps in ((2, 3), (4, 2), (3, 2), (1, 1)):        # three resumes, each on another world size
        part, state = _run(_replicas(n_items, n, state), gb, steps, n_items)
        got += part
    assert state == want_state == {"epoch": 0, "seed": 2, "consumed_global": 96}
    assert [sorted(b) for b in got] == [sorted(b) for b in want]    # the same global batch at every step
    perm = np.random.default_rng((2, 0)).permutation(n_items)
    assert sorted(i for b in got for i in b) == sorted(perm[:96].tolist())   # every sample once, none repeated


@pytest.mark.parametrize("cuts", [(3, 7, 12), (1, 2, 3, 4, 5, 6, 7, 8)])
def test_sampler_resumed_n_times_across_epochs_equals_uninterrupted(cuts):
    """Resumes mid-epoch and exactly at an epoch's end (step 7 of 7) give the uninterrupted batches."""
    n_items, gb, steps = 30, 4, 20                            # 7 steps per epoch on 2 replicas
    want, want_state = _run(_replicas(n_items, 2), gb, steps, n_items)
    got, state, done = [], None, 0
    for cut in cuts + (steps,):
        part, state = _run(_replicas(n_items, 2, state), gb, cut - done, n_items)
        got, done = got + part, cut
    assert got == want and state == want_state
    assert state["epoch"] == 2 and state["consumed_global"] == (steps - 14) * gb


def test_sampler_resume_errors_name_values():
    s = DistributedSampler(range(40), num_replicas=4, rank=3)
    with pytest.raises(ValueError, match=r"rank 3: cannot resume at global sample 6 on num_replicas=4"):
        s.load_state_dict({"epoch": 0, "consumed_global": 6})
    with pytest.raises(ValueError, match=r"rank 3: advance\(\) needs a non-negative int, got -1"):
        s.advance(-1)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_batch_size(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        DataLoader(TensorDataset(np.arange(5)), batch_size=bad)


# ---------------------------------------------------------------- corpus

def test_corpus_is_deterministic_and_within_budget():
    a = load_stdlib_corpus(200_000)
    b = load_stdlib_corpus(200_000)
    assert a == b
    assert 190_000 < len(a.encode("utf-8")) <= 200_000
    assert "def " in a and "import " in a
    assert load_stdlib_corpus(1000) == a.encode()[:1000].decode("utf-8", errors="ignore")


def test_corpus_skips_tests_and_non_utf8(tmp_path):
    (tmp_path / "a.py").write_text("alpha\n")
    (tmp_path / "b.py").write_bytes(b"bad \xff\xfe bytes\n")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "c.py").write_text("in a test dir\n")
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "d.py").write_text("delta\n")
    (tmp_path / "z" / "test_e.py").write_text("a test file\n")
    assert load_stdlib_corpus(1000, root=str(tmp_path)) == "alpha\n\ndelta\n"
    assert load_stdlib_corpus(3, root=str(tmp_path)) == "alp"
    with pytest.raises(ValueError, match="-5"):
        load_stdlib_corpus(-5)


def test_tokenizer_round_trip_and_state():
    text = load_stdlib_corpus(100_000) + "é→"
    tok = CharTokenizer(text)
    ids = tok.encode(text)
    assert ids.dtype == np.int64 and ids.shape == (len(text),)
    assert tok.decode(ids) == text
    assert tok.chars == sorted(set(text)) and tok.vocab_size == len(set(text))
    assert ids.max() == tok.vocab_size - 1
    tok2 = CharTokenizer.from_state_dict(tok.state_dict())
    np.testing.assert_array_equal(tok2.encode("def f(x):"), tok.encode("def f(x):"))
    with pytest.raises(ValueError, match="\U0001F600"):
        tok.encode("a\U0001F600")
    with pytest.raises(ValueError, match="token ids"):
        tok.decode([tok.vocab_size])


def test_char_dataset_windows_shift_by_one():
    tokens = np.arange(100, dtype=np.int32) * 3
    ds = CharDataset(tokens, 8)
    assert len(ds) == 92
    x, y = ds[91]
    assert x.dtype == y.dtype == np.int64
    np.testing.assert_array_equal(x, tokens[91:99])
    np.testing.assert_array_equal(y, tokens[92:100])
    bx, by = next(iter(DataLoader(ds, batch_size=16, shuffle=True, seed=4)))
    order = np.random.default_rng((4, 0)).permutation(92)[:16]
    for r, i in enumerate(order):
        np.testing.assert_array_equal(bx[r], tokens[i:i + 8])
        np.testing.assert_array_equal(by[r], tokens[i + 1:i + 9])
    with pytest.raises(ValueError, match="100"):
        CharDataset(tokens, 100)


def test_unigram_entropy_closed_form():
    assert unigram_entropy([3, 3, 3]) == 0.0
    assert unigram_entropy([0, 1, 2, 3]) == pytest.approx(math.log(4), abs=1e-12)
    p = np.array([0.5, 0.25, 0.25])
    assert unigram_entropy([0, 0, 1, 2]) == pytest.approx(-(p * np.log(p)).sum(), abs=1e-12)
