"""Placements alone locate every parameter, and the optimizer state checkpoints under N-D layouts.

* Each parameter gathered by its :class:`~axonmpi.distributed.Placement` alone (``parallel.placed``:
  its cuts and full shape; an FSDP flat chunk by its own placement first) is the serial parameter,
  under every layout of ``tests/test_nd_layouts.py`` (Megatron with q/k/v, AxoNN blocks with depth
  chunks, experts, tensor-parallel experts, FSDP flat chunks, pipeline stages, context parallel).
* ``training_state(pm, opt)`` of a pipelined or FSDP x tensor-parallel layout (model and AdamW moments
  as serial-named blocks) loads under another layout and into the plain model with a plain AdamW; one
  more AdamW step (clipping on) then equals the serial run's third step: loss, clip norm, parameters.

Marked ``nd`` (the 8/16-rank pass of ``make test``).
"""
from __future__ import annotations

import numpy as np
import pytest

import axonmpi
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.distributed import placement_of
from axonmpi.optim import AdamW, clip_grad_norm_
from axonmpi.parallel import full_state_dict, placed
from axonmpi.parallel._flat import FlatParameter
from axonmpi.parallel.state import ShardedState

from test_nd_layouts import LAYOUTS, MAX_NORM, STEPS, _at_16, _batch, _build, _close, _make, _serial_run, \
    _train_step

pytestmark = pytest.mark.nd

def _flats(pm):
    return pm.flat_parameters()


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_parameter_gathered_by_its_placement_alone_is_the_serial_one(world, layout):
    """Before any step every parameter (whole model on every rank; FSDP's from its flat chunk) gathered
    by its placement's cuts equals the serial model's: no layer is asked."""
    _at_16(world, layout)
    want = _make(LAYOUTS[layout][0]).state_dict()
    grid, pm = _build(world, layout)
    try:
        local = {}
        for f in _flats(pm):                        # an FSDP chunk: its own placement gives the flat buffer
            flat = placed.gather(f.data, placement_of(f))
            assert flat.shape == (f.total_numel,)
            local.update({id(q): v for q, v in zip(f.params, f.layout.views(flat))})
        seen = 0
        for n, p in pm.inner.named_parameters():
            pl = placement_of(p)
            assert pl.full_shape == tuple(np.shape(want[n])), f"{layout}: {n} placement {pl.describe()}"
            v = local.get(id(p), p.data)
            if np.size(v) != int(np.prod(placed.local_shape(pl))):
                continue                            # another stage's parameter, flattened by its FSDP
            _close(placed.gather(v, pl), want[n], f"{layout}: {n} gathered by {pl.describe()}")
            seen += 1
        assert seen >= len(want) // 2, f"{layout}: only {seen} of {len(want)} parameters checked"
        cut = [n for n, p in pm.inner.named_parameters() if placement_of(p).layout]
        opts = LAYOUTS[layout][2]
        if opts.get("tensor_parallel") or opts.get("expert_parallel"):     # else only FSDP's flat chunks are cut
            assert cut, f"{layout}: no parameter is cut"
    finally:
        grid.free()


OPTIM_PAIRS = [("dp_pp2_tp2_zbv", "fsdp_tp2_sp_cp2_ring"), ("fsdp_pp2_axonn2_1f1b", "dp_pp2_tp2_sp_1f1b"),
               ("fsdp_tp2_sp_cp2_ring", "fsdp_pp2_tp2_zbv"), ("fsdp_axonn2_cp2_ac", "dp_pp2_axonn2_gpipe"),
               ("moe_dp_pp2_tp2_ep2", "moe_fsdp_pp2_tp2_ep2")]


def _check_step(loss, norm, got, layout, what):
    want_losses, want_norms, want = _serial_run(LAYOUTS[layout][0])
    _close(loss, want_losses[STEPS - 1], f"{what}: loss")
    _close(norm, want_norms[STEPS - 1], f"{what}: clip norm")
    for k, v in want.items():
        _close(got[k], v, f"{what}: {k}")


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("saved,loaded", OPTIM_PAIRS, ids=[f"{a}->{b}" for a, b in OPTIM_PAIRS])
def test_optimizer_state_resumes_under_another_layout_and_in_the_plain_model(world, saved, loaded,
                                                                              tmp_path_factory):
    """Two steps under ``saved``, ``training_state`` saved (sharded: blocks); restored under ``loaded``
    (its own training_state the template) and into the plain model with a plain AdamW (whose moments equal
    the saved layout's ``full_optim_state_dict``); the third step equals the serial run's in both."""
    _at_16(world, saved, loaded)
    assert STEPS == 3
    name = LAYOUTS[saved][0]
    path = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("os")) if world.rank == 0 else None) + "/ckpt"
    old = world.grid
    grid, pm = _build(world, saved)
    try:
        world.grid = grid
        opt = AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
        for s in range(STEPS - 1):
            _train_step(pm, grid, opt, s)
        state = axonmpi.checkpoint.training_state(pm, opt, step=STEPS - 1)
        cut = [v for st in state["optimizer"]["state"].values() for v in st.values()
               if isinstance(v, axonmpi.checkpoint.ShardedArray) and v.local_shape != v.global_shape]
        assert cut, f"{saved}: the moments must be saved as this rank's blocks"
        axonmpi.checkpoint.save(path, state)
        moments = pm.sharded_state().full_optim_state_dict(opt)["state"]     # full arrays, every rank
    finally:
        world.grid = old
        grid.free()
    grid, pm2 = _build(world, loaded, seed=99)
    try:
        world.grid = grid
        opt2 = AdamW(pm2.parameters(), lr=1.0)
        template = axonmpi.checkpoint.training_state(pm2, opt2, step=0)
        meta = axonmpi.checkpoint.restore_training_state(axonmpi.checkpoint.load(path, template), pm2, opt2)
        assert meta["step"] == STEPS - 1
        loss, norm = _train_step(pm2, grid, opt2, STEPS - 1)
        _check_step(loss, norm, full_state_dict(pm2), loaded, f"saved {saved}, resumed {loaded}")
    finally:
        world.grid = old
        grid.free()
    full = axonmpi.checkpoint.load(path, None)              # full arrays: the plain model and optimizer
    plain = _make(name)
    plain.load_state_dict(full["model"])
    popt = AdamW(plain.parameters(), lr=1.0)
    ShardedState(plain).load_optim_state_dict(popt, full["optimizer"])
    for n, p in plain.named_parameters():
        assert popt.state[p]["step"] == STEPS - 1
        for k in ("exp_avg", "exp_avg_sq"):
            _close(popt.state[p][k], moments[n][k], f"saved {saved}: {n} {k} (full_optim_state_dict)")
    x, y = _batch(STEPS - 1)
    popt.zero_grad()
    lp = F.cross_entropy(plain(Tensor(x)), y)
    lp.backward()
    norm = float(clip_grad_norm_(plain.parameters(), MAX_NORM))
    popt.step()
    _check_step(float(lp.data), norm, plain.state_dict(), saved, f"saved {saved}, resumed in the plain model")
