"""``pm.parameters()`` are the model's own parameters under every layout, and a whole user training step on them
equals serial (issue 48, item 1; FSDP1's ``use_orig_params=True`` semantics).

nanoGPT's and minGPT's ``configure_optimizers`` rules are applied to ``pm.named_parameters()`` /
``pm.named_modules()`` under FSDP (each strategy), FSDP x Megatron, FSDP x a pipeline and AxoNN, at 2 and 4 ranks;
then 3 float64 AdamW steps with a ``GradScaler`` of a large scale (``unscale_`` in place), a user's in-place edit of
some gradients (``p.grad.mul_``), ``clip_grad_norm_(pm.parameters())`` and per-group weight decay: every step's clip
norm and the parameters afterwards equal the serial run's to 1e-10.  Under FSDP each original's ``.grad`` is a view
of its elements in the rank's flat chunk ([Note: the originals' gradients are views of the chunk], parallel/_flat.py),
so the scaler's and the user's edits reach what clipping and the step read.
"""
import numpy as np
import pytest

import axonmpi
from axonmpi.amp import GradScaler
from axonmpi.optim import AdamW
from axonmpi.optim.clip import clip_grad_norm_
from axonmpi.parallel import full_state_dict, parallelize
from axonmpi.parallel.module import PipelinedModule

from test_param_identity import LAYOUTS as _ALL, MAX_NORM, RULES, STEPS, _batch, _close, _loss, _make, _names

SCALE = 2.0 ** 12
LAYOUTS = ["fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard", "fsdp2_x_megatron2", "pp2_fsdp2",
           "axonn_2row"]


def _edit(named):
    """The user's in-place gradient edit: halve the 1-D parameters' gradients (after ``unscale_``)."""
    for _, p in named:
        if p.dim() < 2 and p.grad is not None:
            p.grad.mul_(0.5)


def _serial(rule):
    model = _make()
    opt = AdamW(RULES[rule](model), lr=1e-2, betas=(0.9, 0.95))
    scaler = GradScaler(init_scale=SCALE)
    norms = []
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        scaler.scale(_loss(model(x), y)).backward()
        scaler.unscale_(opt)
        _edit(model.named_parameters())
        norms.append(float(clip_grad_norm_(model.parameters(), MAX_NORM)))
        scaler.step(opt)
        scaler.update()
    assert min(norms) > MAX_NORM and scaler.get_scale() == SCALE
    return model.state_dict(), norms, _names(RULES[rule](model), model)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_user_step_on_pm_parameters_matches_serial(world, layout, rule):
    """Serial names and shapes from ``pm.named_parameters()``; the rule's groups as serially; scaler, edit, clip
    and AdamW steps equal serial."""
    if world.world_size not in (2, 4):
        pytest.skip("the layouts are for 2 and 4 ranks")
    want, want_norms, want_groups = _serial(rule)
    sizes, opts = _ALL[layout]
    grid = axonmpi.ProcessGrid(world, **sizes)
    old, world.grid = world.grid, grid
    try:
        model = _make()
        serial = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        pm = parallelize(model, grid=grid, **opts)
        piped = isinstance(pm, PipelinedModule)
        mine = [(n, tuple(p.shape)) for n, p in pm.named_parameters()]
        assert mine == [e for e in serial if e in mine] and (piped or mine == serial), layout
        ids = {id(p) for p in model.parameters()}
        assert all(id(p) in ids for p in pm.parameters()), f"{layout}: pm.parameters() are the model's own"
        groups = RULES[rule](pm)
        if not piped:                    # a pipeline's rank holds its stages' parameters only
            assert _names(groups, model) == want_groups, layout
        opt = AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
        scaler = GradScaler(init_scale=SCALE)
        for s in range(STEPS):
            xb, yb = pm.local_batch(*_batch(s))
            opt.zero_grad()
            if piped:
                pm.step(xb, yb, scaler=scaler)
            else:
                scaler.scale(_loss(pm(xb), yb)).backward()
            scaler.unscale_(opt)
            _edit(pm.named_parameters())
            norm = float(clip_grad_norm_(pm.parameters(), MAX_NORM))
            _close(norm, want_norms[s], f"{layout}/{rule}: step {s} clip norm")
            scaler.step(opt)
            scaler.update()
        got = full_state_dict(pm)
        for k in want:
            _close(got[k], want[k], f"{layout}/{rule}: {k}")
    finally:
        world.grid = old
        grid.free()


@pytest.mark.mpi(min_size=2)
def test_fsdp_original_grad_views_the_chunk(world):
    """FSDP alone: after backward each original's ``.grad`` is a 1-D view of its elements in the rank's chunk (an
    in-place edit reaches the chunk); the next forward drops the views, the chunk keeps the gradient (no
    ``zero_grad``: accumulation), and ``zero_grad`` empties both."""
    from axonmpi.parallel import FSDP
    model = _make()
    fsdp = FSDP(model)
    x, y = _batch(0)
    _loss(fsdp(x), y).backward()
    flats = list(fsdp.parameters())
    before = [f.grad.data.copy() for f in flats]
    for p in model.parameters():
        owner, i = p.__dict__["_local_owner"]
        a, b = owner._piece_bounds(i)
        assert p.grad.data.ndim == 1 and p.grad.data.size == b - a and p.dim() == len(p.shape)
        p.grad.mul_(2.0)
    for f, g in zip(flats, before):
        _close(f.grad.data, 2 * g, "the chunk after p.grad.mul_(2)")
    _loss(fsdp(x), y).backward()        # accumulates: 2g + g
    for f, g in zip(flats, before):
        _close(f.grad.data, 3 * g, "the chunk after a second backward")
    opt = AdamW(model.parameters(), lr=1e-2)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(not np.any(f.grad.data) for f in flats if f.grad is not None)
