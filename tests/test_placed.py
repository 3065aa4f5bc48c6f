"""``axonmpi.parallel.placed``: a placement's cuts take the full array to each rank's piece, the pieces tile
the full array once, and a piece's checkpoint rectangle gives the piece back -- for every kind of cut
(Megatron dims, fused q/k/v parts, AxoNN blocks with depth chunks, FSDP's uneven flat chunks).

One process: cutting reads only each group's size and this rank's index in it (gathering is checked
by ``tests/test_sharded_state.py`` under the N-D layouts).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from axonmpi.distributed import Cut, Placement, Shard, ShardKind
from axonmpi.parallel import placed


class _G:
    """A group as the cuts read it: its size and this rank's index in it."""

    def __init__(self, name, size, rank):
        self.name, self.size, self.rank = name, size, rank


# name: (full shape, {group: size}, cuts over those groups)
CASES = {
    "column": ((8, 6), {"tp": 2}, lambda g: (Cut(g["tp"], 0),)),
    "row": ((8, 6), {"tp": 2}, lambda g: (Cut(g["tp"], 1),)),
    "qkv": ((12, 4), {"tp": 2}, lambda g: (Cut(g["tp"], 0, parts=3),)),
    "axonn_rows": ((8, 6), {"o": 2, "i": 3, "d": 2}, lambda g: (Cut(g["o"], 0), Cut(g["i"], 1), Cut(g["d"], None))),
    "axonn_split_rows": ((6, 4), {"o": 2, "i": 2, "d": 2}, lambda g: (Cut(g["o"], 0), Cut(g["i"], 1),
                                                                     Cut(g["d"], None))),
    "axonn_embedding": ((5, 4), {"s": 2, "d": 2}, lambda g: (Cut(g["s"], 1), Cut(g["d"], None))),
    "fsdp_uneven": ((7,), {"f": 3}, lambda g: (Cut(g["f"], None),)),
    "expert_last_dim": ((4, 3, 6), {"e": 2}, lambda g: (Cut(g["e"], -1),)),
}


def _ranks(sizes):
    names = list(sizes)
    for idx in itertools.product(*(range(sizes[n]) for n in names)):
        yield {n: _G(n, sizes[n], r) for n, r in zip(names, idx)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pieces_tile_the_full_array_once_and_blocks_give_them_back(case):
    shape, sizes, cuts = CASES[case]
    full = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    seen = []
    for groups in _ranks(sizes):
        pl = Placement(shards=tuple(Shard(c.group, ShardKind.DIM, c.dim) for c in cuts(groups)),
                       full_shape=shape, cuts=cuts(groups))
        piece = placed.cut(full, pl)
        assert piece.shape == placed.local_shape(pl), case
        seen.append(piece.reshape(-1))
        k, offsets, rect = placed._rect(pl)          # the rectangle a checkpoint writes for this piece
        region = full[tuple(slice(o, o + n) for o, n in zip(offsets, rect))]
        np.testing.assert_array_equal(placed.unblock(region, pl), piece, err_msg=case)
        if k == len(pl.layout):                      # a rectangle itself: its block is a view of the piece
            np.testing.assert_array_equal(placed.block(piece, pl).local, region, err_msg=case)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), full.reshape(-1), err_msg=case)


def test_which_pieces_are_rectangles():
    """A dim cut and a flattened cut of whole rows keep the rectangle; q/k/v parts and part-row chunks do not."""
    def k_of(case):
        shape, sizes, cuts = CASES[case]
        groups = next(_ranks(sizes))
        return placed._rect(Placement(full_shape=shape, cuts=cuts(groups)))[0]
    assert k_of("column") == 1 and k_of("axonn_rows") == 3 and k_of("axonn_embedding") == 1
    assert k_of("qkv") == 0 and k_of("axonn_split_rows") == 2 and k_of("fsdp_uneven") == 0


def test_a_placement_without_a_full_shape_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="has no full_shape.*full_shape="):
        placed.local_shape(Placement(cuts=(Cut(_G("tp", 2, 0), 0),)))


def test_sharded_state_of_a_plain_model_and_its_optimizer_round_trips_with_adamw_and_zero():
    """``ShardedState`` of a plain model (one process): both forms of the model and of AdamW's state load
    into a fresh model and optimizer exactly; a ZeRO-1 optimizer's state goes through the same form (each
    parameter's moments gathered from its buckets) and loads into AdamW and back into a ZeRO-1 optimizer."""
    import axonmpi
    import axonmpi.nn as nn
    import axonmpi.nn.functional as F
    from axonmpi import Tensor
    from axonmpi.optim import AdamW, ZeroRedundancyOptimizer
    from axonmpi.parallel.state import ShardedState

    def make():
        axonmpi.manual_seed(3)
        return nn.Sequential(nn.Linear(3, 4, dtype=np.float64), nn.LayerNorm(4, dtype=np.float64))
    m, x = make(), np.random.default_rng(0).standard_normal((5, 3))
    opt = AdamW(m.parameters(), lr=0.1)
    F.mse_loss(m(Tensor(x)), Tensor(np.ones((5, 4)))).backward()
    opt.step()
    st = ShardedState(m)
    for model_sd, optim_sd in ((st.full_state_dict(), st.full_optim_state_dict(opt)),
                               (st.sharded_state_dict(), st.optim_state_dict(opt))):
        m2 = make()
        opt2 = AdamW(m2.parameters(), lr=0.1)
        ShardedState(m2).load_state_dict(model_sd)
        ShardedState(m2).load_optim_state_dict(opt2, optim_sd)
        for (n, p), q in zip(m.named_parameters(), m2.parameters()):
            np.testing.assert_array_equal(q.data, p.data, err_msg=n)
            for k in ("exp_avg", "exp_avg_sq"):
                np.testing.assert_array_equal(opt2.state[q][k], opt.state[p][k], err_msg=f"{n} {k}")
            assert opt2.state[q]["step"] == 1
    m3 = make()
    zero = ZeroRedundancyOptimizer(m3.parameters(), AdamW, lr=0.1)
    F.mse_loss(m3(Tensor(x)), Tensor(np.ones((5, 4)))).backward()
    zero.step()
    full = ShardedState(m3).full_optim_state_dict(zero)          # the same moments as the plain AdamW's
    for n, p in m.named_parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_allclose(full["state"][n][k], opt.state[p][k], rtol=1e-14, err_msg=f"zero {n} {k}")
        assert full["state"][n]["step"] == 1
    m4 = make()
    zero2 = ZeroRedundancyOptimizer(m4.parameters(), AdamW, lr=0.1)
    ShardedState(m4).load_optim_state_dict(zero2, ShardedState(m3).optim_state_dict(zero))
    again = ShardedState(m4).full_optim_state_dict(zero2)
    for n in full["state"]:
        for k in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(again["state"][n][k], full["state"][n][k], err_msg=f"zero reloaded {n} {k}")
