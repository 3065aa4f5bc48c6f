"""issue 48 items 3 (the token count's one source) and 4 (any parameter shape saves and loads) for pipelines.

* A pipeline's loss counts the targets its loss function ignores: ``nn.CrossEntropyLoss(ignore_index=-1)`` or
  ``functools.partial(F.cross_entropy, ignore_index=-1)`` with ``PipelinePlan`` at its default equals the serial
  run (float64, 1e-10); an ``ignore_index`` that disagrees with the loss function's is refused at construction; a
  lambda whose ignore value cannot be read is refused at its first step when its targets hold another negative.
* A model with a 0-d learnable scalar, a 1-d gain and odd sizes on either stage: ``sharded_state_dict()`` /
  ``training_state()`` on every rank, saved with the checkpoint API and loaded into another layout (pp2 -> serial,
  pp2 -> pp2 with other boundaries, serial -> pp2), then one more step equals the serial run.
"""
import functools

import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
from axonmpi import Tensor
from axonmpi.nn import functional as F
from axonmpi.optim import AdamW
from axonmpi.optim.clip import clip_grad_norm_
from axonmpi.parallel import full_state_dict, parallelize
from axonmpi.parallel.parallelize import PipelinePlan
from axonmpi.parallel.token_mean import FROM_LOSS, loss_ignore_index, resolve_ignore_index

TOL, MAX_NORM, STEPS = 1e-10, 0.05, 3
V, D = 7, 5


class Scale(nn.Module):
    """``x * exp(t)`` with ``t`` a 0-d learnable temperature (a ViT's / CLIP's logit scale)."""

    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(Tensor(np.array(0.3), dtype=np.float64))

    def forward(self, x):
        return x * self.t.exp()


class Gain(nn.Module):
    """An odd-sized 1-d gain."""

    def __init__(self, n):
        super().__init__()
        self.g = nn.Parameter(Tensor(np.linspace(0.5, 1.5, n), dtype=np.float64))

    def forward(self, x):
        return x * self.g


def _model(scalar_at_end=True):
    axonmpi.manual_seed(4)
    layers = [nn.Embedding(V, D, dtype="float64"), nn.Linear(D, 3, dtype="float64"), nn.Tanh(), Gain(3),
              nn.Linear(3, D, dtype="float64"), nn.Linear(D, V, dtype="float64")]
    layers.insert(len(layers) if scalar_at_end else 1, Scale())
    return nn.Sequential(*layers)


def _batches(ignore=-1, n=STEPS):
    rng = np.random.default_rng(9)
    out = []
    for _ in range(n):
        x, y = rng.integers(0, V, (8, 3)), rng.integers(0, V, (8, 3))
        y[rng.random(y.shape) < 0.3] = ignore             # uneven ignored targets per micro-batch
        out.append((x, y))
    return out


def _flat_ce(ignore):
    return lambda out, y: F.cross_entropy(out.reshape(-1, V), _raw(y).reshape(-1), ignore_index=ignore)


def _raw(y):
    return y.data if isinstance(y, Tensor) else np.asarray(y)


class _FlatCE(nn.CrossEntropyLoss):
    """nn.CrossEntropyLoss over (B, T, V) logits, as a language model calls it."""

    def forward(self, out, y):
        return super().forward(out.reshape(-1, V), _raw(y).reshape(-1))


def _serial(make, batches, ignore, steps=STEPS):
    ref = make()
    opt = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    want = []
    for x, y in batches[:steps]:
        opt.zero_grad()
        loss = _flat_ce(ignore)(ref(x), y)
        loss.backward()
        want.append((float(loss.item()), float(clip_grad_norm_(ref.parameters(), MAX_NORM))))
        opt.step()
    return want, ref.state_dict(), ref, opt


def _grid(world, sizes):
    need = int(np.prod(list(sizes.values())))
    if world.world_size % need:
        pytest.skip(f"needs a multiple of {need} ranks")
    return axonmpi.ProcessGrid(world, **sizes)


def _train(pm, opt, batches):
    got = []
    for x, y in batches:
        opt.zero_grad()
        loss = pm.step(*pm.local_batch(x, y))
        got.append((loss, float(clip_grad_norm_(pm.parameters(), MAX_NORM))))
        opt.step()
    return got


def _close(got, want, what):
    for s, ((lg, ng), (lw, nw)) in enumerate(zip(got, want)):
        assert abs(lg - lw) <= TOL * abs(lw), (what, s, lg, lw)
        assert abs(ng - nw) <= TOL * abs(nw), (what, s, ng, nw)


LOSSES = {"module": lambda: _FlatCE(ignore_index=-1),
          "partial": lambda: functools.partial(_flat_ce_fn, ignore_index=-1)}


def _flat_ce_fn(out, y, ignore_index=-100):
    return F.cross_entropy(out.reshape(-1, V), _raw(y).reshape(-1), ignore_index=ignore_index)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_counts_the_targets_its_loss_ignores(world, loss, pp):
    """ignore_index=-1 in the loss only (PipelinePlan at its default): equal to serial at 1e-10 (float64).  Before,
    the pipeline counted with -100 and the loss was off ~1e-3."""
    grid = _grid(world, {"G_inter": pp})
    batches = _batches(-1)
    want, want_sd, _, _ = _serial(_model, batches, -1)
    try:
        pm = parallelize(_model(), grid=grid, pipeline=PipelinePlan(2 * pp, "1f1b", loss_fn=LOSSES[loss]()))
        assert pm.pipeline.ignore_index == -1
        opt = AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
        _close(_train(pm, opt, batches), want, f"{loss} pp{pp}")
        got = full_state_dict(pm)
        for k, v in want_sd.items():
            np.testing.assert_allclose(got[k], v, rtol=TOL, atol=1e-13, err_msg=k)
    finally:
        grid.free()


def test_the_ignore_index_is_read_from_the_loss_function():
    assert loss_ignore_index(nn.CrossEntropyLoss(ignore_index=-1))[0] == -1
    assert loss_ignore_index(functools.partial(F.cross_entropy, ignore_index=3))[0] == 3
    assert loss_ignore_index(F.cross_entropy)[0] == -100 and loss_ignore_index(None)[0] == -100
    assert resolve_ignore_index(nn.NLLLoss(ignore_index=-7), FROM_LOSS, 0) == (-7, True)
    assert resolve_ignore_index(lambda o, t: o, FROM_LOSS, 0) == (-100, False)
    assert resolve_ignore_index(F.cross_entropy, -100, 0) == (-100, True)


def test_an_ignore_index_that_disagrees_with_the_loss_is_refused():
    with pytest.raises(ValueError, match=r"ignore_index=-100 but its loss function ignores -1 "
                                         r"\(_FlatCE.ignore_index\).*Leave ignore_index out"):
        resolve_ignore_index(_FlatCE(ignore_index=-1), -100, 0)
    with pytest.raises(ValueError, match="ignores -100"):
        resolve_ignore_index(F.cross_entropy, None, 0)


@pytest.mark.mpi(min_size=2)
def test_pipeline_plan_refuses_the_disagreement_at_construction(world):
    grid = _grid(world, {"G_inter": 2})
    try:
        with pytest.raises(ValueError, match="ignore_index=-100 but its loss function ignores -1"):
            parallelize(_model(), grid=grid, pipeline=PipelinePlan(2, loss_fn=_FlatCE(ignore_index=-1),
                                                                   ignore_index=-100))
    finally:
        grid.free()


@pytest.mark.mpi(min_size=2)
def test_an_unreadable_loss_with_other_negative_targets_is_refused_at_its_first_step(world):
    grid = _grid(world, {"G_inter": 2})
    try:
        pm = parallelize(_model(), grid=grid, pipeline=PipelinePlan(2, loss_fn=_flat_ce(-1)))
        x, y = _batches(-1, 1)[0]
        with pytest.raises(ValueError, match=r"targets hold -1.*ignore_index=-1"):   # every rank, before any transfer
            pm.step(*pm.local_batch(x, y))
        pm2 = parallelize(_model(), grid=grid, pipeline=PipelinePlan(2, loss_fn=_flat_ce(-1), ignore_index=-1))
        want, _, _, _ = _serial(_model, _batches(-1), -1, steps=1)
        opt = AdamW(pm2.parameters(), lr=1e-2, weight_decay=0.1)
        _close(_train(pm2, opt, _batches(-1)[:1]), want, "explicit ignore_index=-1 with a lambda")
    finally:
        grid.free()


# -- item 4: 0-d, 1-d and odd-sized parameters on any stage save and load ----------------------------------------
LAYOUTS = {"pp2": ({"G_inter": 2}, None), "pp2_other_cut": ({"G_inter": 2}, (2,)), "pp2_fsdp": ({"G_inter": 2}, None)}


def _path(world, tmp_path_factory, name):
    base = str(tmp_path_factory.mktemp(name)) if world.rank == 0 else None
    return axonmpi.broadcast_object(base) + "/ckpt"


def _build(world, layout, scalar_at_end):
    sizes, cut = LAYOUTS[layout]
    grid = _grid(world, sizes)
    dp = "fsdp" if layout.endswith("fsdp") else "ddp"
    pm = parallelize(_model(scalar_at_end), grid=grid, data_parallel=dp,
                     pipeline=PipelinePlan(2, "1f1b", loss_fn=_FlatCE(ignore_index=-1), boundaries=cut))
    return grid, pm


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("scalar_at_end", [True, False], ids=["scalar_last_stage", "scalar_first_stage"])
@pytest.mark.parametrize("saved,loaded", [("pp2", "pp2_other_cut"), ("pp2_fsdp", "pp2"), ("pp2", None),
                                          (None, "pp2_fsdp")],
                         ids=["pp2->pp2_other_cut", "pp2_fsdp->pp2", "pp2->serial", "serial->pp2_fsdp"])
def test_a_0d_parameter_on_one_stage_saves_and_loads_across_layouts(world, tmp_path_factory, scalar_at_end, saved,
                                                                     loaded):
    """Two steps under ``saved`` (None: the plain model in one process on every rank), ``training_state`` saved
    with the checkpoint API; loaded under ``loaded`` (its own training_state the template; None: full arrays into
    the plain model); the third step equals the serial run's (loss, clip norm, every parameter incl. the 0-d one).
    Before: ``sharded_state_dict()`` raised ValueError about ShardedArray on the ranks of the other stage."""
    make = functools.partial(_model, scalar_at_end)
    batches = _batches(-1)
    want, want_sd, _, _ = _serial(make, batches, -1)
    path = _path(world, tmp_path_factory, "zero_d")
    old = world.grid
    if saved is None:
        _, _, ref, ref_opt = _serial(make, batches, -1, steps=STEPS - 1)
        state = axonmpi.checkpoint.training_state(ref, ref_opt, step=STEPS - 1)
        axonmpi.checkpoint.save(path, state)
    else:
        grid, pm = _build(world, saved, scalar_at_end)
        try:
            world.grid = grid
            opt = AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
            _train(pm, opt, batches[:STEPS - 1])
            sd = pm.sharded_state_dict()
            key = "6.t" if scalar_at_end else "1.t"
            assert sd[key].global_shape == ()            # both stages list it; one holds it
            axonmpi.checkpoint.save(path, axonmpi.checkpoint.training_state(pm, opt, step=STEPS - 1))
        finally:
            world.grid = old
            grid.free()
    if loaded is None:
        full = axonmpi.checkpoint.load(path, None)
        plain = make()
        plain.load_state_dict(full["model"])
        popt = AdamW(plain.parameters(), lr=1.0)
        from axonmpi.parallel.state import ShardedState
        ShardedState(plain).load_optim_state_dict(popt, full["optimizer"])
        x, y = batches[STEPS - 1]
        popt.zero_grad()
        loss = _flat_ce(-1)(plain(x), y)
        loss.backward()
        got = [(float(loss.item()), float(clip_grad_norm_(plain.parameters(), MAX_NORM)))]
        popt.step()
        got_sd = plain.state_dict()
    else:
        grid, pm = _build(world, loaded, scalar_at_end)
        try:
            world.grid = grid
            opt = AdamW(pm.parameters(), lr=1.0)
            template = axonmpi.checkpoint.training_state(pm, opt, step=0)
            meta = axonmpi.checkpoint.restore_training_state(axonmpi.checkpoint.load(path, template), pm, opt)
            assert meta["step"] == STEPS - 1
            got = _train(pm, opt, batches[STEPS - 1:])
            got_sd = full_state_dict(pm)
        finally:
            world.grid = old
            grid.free()
    _close(got, want[STEPS - 1:], f"{saved} -> {loaded}")
    for k, v in want_sd.items():
        np.testing.assert_allclose(got_sd[k], v, rtol=TOL, atol=1e-13, err_msg=f"{saved} -> {loaded}: {k}")


def test_an_empty_block_of_a_0d_array():
    from axonmpi.checkpoint import ShardedArray
    e = ShardedArray.empty((), np.float64)
    assert e.is_empty and e.global_shape == () and e.local.shape == (0,) and e.dtype == np.float64
    assert not ShardedArray(np.array(2.0), (), ()).is_empty
    assert ShardedArray.empty((5, 3)).local.shape == (0, 3)


def test_a_plain_optimizers_state_of_several_groups_is_refused_not_skipped():
    from axonmpi.parallel.state import ShardedState
    model = _model()
    params = list(model.parameters())
    opt = AdamW([{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}], lr=1e-2)
    model(np.zeros((2, 3), np.int64)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="keyed by index.*2 parameter group"):
        ShardedState(model).load_optim_state_dict(opt, opt.state_dict())
    one = AdamW(model.parameters(), lr=1e-2)
    one.step()
    fresh = AdamW(model.parameters(), lr=1e-2)
    ShardedState(model).load_optim_state_dict(fresh, one.state_dict())
    for p in model.parameters():
        np.testing.assert_array_equal(fresh.state[p]["exp_avg"], one.state[p]["exp_avg"])


# -- item 8: the refusals name the module, its class with its module path, the protocol and the fix ----------------
class NoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.b(self.a(x))


def test_a_model_without_pipeline_layers_is_refused_naming_its_class_path_and_the_protocol():
    from axonmpi.parallel.pipeline import split_points
    with pytest.raises(TypeError, match=r"got a test_pipeline_user_models\.NoLayers.*def pipeline_layers\(self\)"
                                        r".*'The pipeline_layers\(\) protocol'"):
        split_points(NoLayers(), 2)


@pytest.mark.mpi(min_size=2)
def test_a_vocabulary_the_tensor_group_cannot_split_is_refused_naming_the_layer(world):
    if world.world_size % 2:
        pytest.skip("needs an even number of ranks")
    grid = _grid(world, {"G_intra_c": 2})
    try:
        with pytest.raises(ValueError, match=r"num_embeddings=7 .*layer '0', a axonmpi\.nn\.layers\.Embedding made "
                                             r"'vocab'.*pad a vocabulary to a multiple of 2"):
            parallelize(_model(), grid=grid, tensor_parallel={"0": "vocab"})
    finally:
        grid.free()
