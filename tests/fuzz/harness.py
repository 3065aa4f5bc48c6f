"""The one serial-vs-layout harness: a model trained on one process and under a layout, compared step by step.

:func:`run_case` trains a :class:`~cases.Case`'s model three AdamW steps (weight decay, clipping) serially on
the global batch and under the case's layout (``parallelize``), and checks, each at 1e-10 relative:

* the loss and the clip norm of every step;
* every entry of ``pm.state_dict()`` (parameters, frozen ones and buffers) after the last step, the same keys
  as the serial model's; ``pm.load_state_dict`` of the serial state dict with ``strict=True`` gives it back,
  and a missing or an unexpected key raises;
* the checkpoint round trip: ``training_state(pm, opt)`` saved after two steps, restored under the case's
  second layout (another grid, another seed's weights), whose third step equals the serial third step.

A refusal at construction (``NotImplementedError`` or ``ValueError`` from ``parallelize``, the same on every
rank) is a clean outcome, reported with its reason; so is an optimizer built before ``parallelize`` (user-style
cases) that holds a parameter a layer replaced, when it raises at its first use naming the fix ("build the optimizer
from pm.parameters() after parallelize"); anything else that differs or raises is a failure.
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import axonmpi
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.optim import AdamW, ZeroRedundancyOptimizer, clip_grad_norm_
from axonmpi.parallel import PipelinePlan, full_state_dict, parallelize
from axonmpi.parallel import UnusedParameterError
from axonmpi.parallel.grad_sync import data_reduction_group

try:
    from .cases import T, Case, LayoutSpec, ModelSpec, batch, build_model, megatron_plan, model_plan, module_names
except ImportError:            # run as a script (tests/fuzz/run.py)
    from cases import T, Case, LayoutSpec, ModelSpec, batch, build_model, megatron_plan, model_plan, module_names
try:
    from .user import generate, param_groups
except ImportError:            # run as a script
    from user import generate, param_groups

__all__ = ["Mismatch", "Refused", "run_case", "serial_run", "close"]

TOL = 1e-10
STEPS = 3
MAX_NORM = 0.05
LR, WD = 1e-2, 0.1


class Mismatch(AssertionError):
    """A layout differs from the serial model."""


class Refused(Exception):
    """``parallelize`` refused the layout at construction, with its reason."""


def close(got, want, what: str, tol: float = TOL) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise Mismatch(f"{what}: shape {got.shape}, serial {want.shape}")
    if got.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(want))), 1e-300)
    err = float(np.max(np.abs(got - want))) / scale
    if not err <= tol:
        raise Mismatch(f"{what}: relative error {err:.3g} (got {got.reshape(-1)[:3]}, serial {want.reshape(-1)[:3]})")
    return err


def _inputs(spec: ModelSpec, x):
    return x if spec.first == "embedding" else Tensor(x)


_SERIAL: Dict[ModelSpec, List[Tuple[float, float, Dict[str, np.ndarray]]]] = {}


def serial_run(spec: ModelSpec):
    """``[(loss, clip norm, state dict after the step)]`` of the serial model over ``STEPS`` steps (cached)."""
    if spec not in _SERIAL:
        model = build_model(spec)
        opt = AdamW(_groups(spec, model), lr=LR, weight_decay=WD)
        out = []
        for s in range(STEPS):
            x, y = batch(spec, s)
            opt.zero_grad()
            loss = F.cross_entropy(model(_inputs(spec, x)), y, ignore_index=spec.ignore_index)
            loss.backward()
            norm = float(clip_grad_norm_(model.parameters(), MAX_NORM))
            opt.step()
            out.append((float(loss.data), norm, {k: np.array(v, copy=True) for k, v in model.state_dict().items()}))
        _SERIAL[spec] = out
    return _SERIAL[spec]


def _groups(spec: ModelSpec, model):
    """What the optimizer is built on: the user's param groups of ``model`` (its own object), or its parameters."""
    return param_groups(model, spec.groups, LR, WD) if spec.groups else list(model.parameters())


def _prompt(spec: ModelSpec):
    return np.random.default_rng(spec.seed).integers(0, spec.vocab, (2, T // 2))


_GENERATED: Dict[ModelSpec, Tuple[np.ndarray, np.ndarray]] = {}


def serial_generate(spec: ModelSpec):
    """The serial model's greedy generate after the last step (cached)."""
    if spec not in _GENERATED:
        model = build_model(spec)
        model.load_state_dict(serial_run(spec)[-1][2])
        _GENERATED[spec] = generate(model, axonmpi.tensor(_prompt(spec)), T - T // 2)
    return _GENERATED[spec]


def generate_refusal(lay: LayoutSpec) -> Optional[str]:
    """Why ``pm(idx)`` on whole sequences is not the user's generate loop under ``lay`` (None: it is)."""
    if lay.schedule:
        return "a pipelined model runs by micro-batches (pm.step); generate with a plain model loaded from pm.state_dict()"
    if lay.context:
        return "context parallelism takes this rank's part of each sequence; generate with a plain model"
    if lay.expert_parallel > 1:
        return ("expert parallelism routes the expert group's tokens together: the same prompt on every rank fills "
                "an expert's capacity twice; generate with a plain model")
    if lay.sequence_parallel:
        return "sequence parallelism splits the sequence over the tensor group; generate with a plain model"
    return None


def check_generate(world, spec: ModelSpec, lay: LayoutSpec, pm) -> None:
    """The user's generate loop through ``pm`` (every rank the same prompt) equals the serial model's."""
    want_idx, want_logits = serial_generate(spec)
    got_idx, got_logits = generate(pm, axonmpi.tensor(_prompt(spec)), T - T // 2)
    agreed(world, close, got_logits, want_logits, "generate: last logits")
    if not np.array_equal(got_idx, want_idx):
        raise Mismatch(f"generate: tokens {got_idx.tolist()}, serial {want_idx.tolist()}")


def options(spec: ModelSpec, lay: LayoutSpec, grid) -> Dict[str, Any]:
    """``parallelize``'s keyword arguments for ``lay``."""
    opts: Dict[str, Any] = dict(grid=grid, data_parallel=lay.data, model_plan=model_plan(spec))
    if lay.tensor == "axonn":
        opts["tensor_parallel"] = "axonn"
    elif lay.tensor == "megatron":
        opts["tensor_parallel"] = megatron_plan(spec, lay)
    if lay.sharding:
        opts["sharding_strategy"] = lay.sharding
        if lay.sharding == "hybrid_shard":
            n = grid.G_data * getattr(grid, "G_context", 1)
            opts["hybrid_shard_size"] = 2 if n % 2 == 0 and n > 2 else 1
    if lay.sequence_parallel:
        opts["sequence_parallel"] = True
    if lay.context:
        opts["context_parallel"] = lay.context
    if spec.has.get("moe"):
        opts["expert_parallel"] = lay.expert_parallel
    if lay.ac == "all":
        opts["activation_checkpointing"] = True
    elif lay.ac == "some":
        names = [n for n, _ in module_names(spec)][::2]
        opts["activation_checkpointing"] = names or True
    if lay.schedule:
        loss = None if spec.ignore_index == -100 else functools.partial(F.cross_entropy, ignore_index=spec.ignore_index)
        opts["pipeline"] = PipelinePlan(num_microbatches=lay.microbatches, schedule=lay.schedule, loss_fn=loss,
                                        virtual_stages=2 if lay.schedule == "interleaved" else None)
    return opts


def _grid(world, lay: LayoutSpec):
    return axonmpi.ProcessGrid(world, **dict(lay.sizes), expert_parallel=lay.expert_parallel)


def build(spec: ModelSpec, lay: LayoutSpec, grid, seed_shift: int = 0):
    """``(pm, optimizer)`` of ``spec`` under ``lay``; ``Refused`` when ``parallelize`` refuses it."""
    from dataclasses import replace
    model = build_model(replace(spec, seed=spec.seed + seed_shift) if seed_shift else spec)

    def make_optimizer():
        if pm is model:       # before parallelize: the user's model, every parameter
            params = _groups(spec, model)
        else:                 # after: the wrapper's (serial names; under a pipeline this rank's stages' only)
            params = param_groups(pm, spec.groups, LR, WD) if spec.groups else list(pm.parameters())
        if lay.zero1:
            return ZeroRedundancyOptimizer(params, AdamW, group=data_reduction_group(grid), lr=LR, weight_decay=WD)
        return AdamW(params, lr=LR, weight_decay=WD)

    pm = model
    opt = make_optimizer() if spec.opt_before else None     # nanoGPT's train.py order: optimizer, then wrap
    try:
        pm = parallelize(model, **options(spec, lay, grid))
    except (NotImplementedError, ValueError) as e:
        raise Refused(f"{type(e).__name__}: {e}") from e
    return pm, (opt if opt is not None else make_optimizer())


def train_step(spec: ModelSpec, pm, opt, s: int) -> Tuple[float, float]:
    """One step on this rank's part of step ``s``'s global batch: the global mean loss and the clip norm."""
    x, y = batch(spec, s)
    xb, yb = pm.local_batch(x, y)
    opt.zero_grad()
    if hasattr(pm, "step"):
        loss = float(pm.step(xb, yb))
    else:
        out = pm(_inputs(spec, xb))
        lsum = F.cross_entropy(out, yb, ignore_index=spec.ignore_index, reduction="sum")
        lm = pm.token_mean(lsum, int((np.asarray(yb) != spec.ignore_index).sum()))
        lm.backward()
        loss = float(lm.item())
    norm = float(clip_grad_norm_(pm.parameters(), MAX_NORM))
    opt.step()
    return loss, norm


def check_values(got: Dict[str, Any], want: Dict[str, np.ndarray], what: str) -> None:
    """A state dict ``got`` equals ``want`` (keys and values)."""
    if sorted(got) != sorted(want):
        raise Mismatch(f"{what}: state_dict keys differ from the serial model's: missing "
                       f"{sorted(set(want) - set(got))}, unexpected {sorted(set(got) - set(want))}")
    for k, v in want.items():
        close(got[k], v, f"{what}: {k}")


def check_strict(world, pm, want: Dict[str, np.ndarray], what: str) -> None:
    """``load_state_dict(strict=True)`` takes the serial state dict and gives it back; a missing and an
    unexpected key each raise, on every rank."""
    agreed(world, pm.load_state_dict, {k: np.array(v, copy=True) for k, v in want.items()}, True)
    agreed(world, check_values, pm.state_dict(), want, f"{what} after load_state_dict(serial)")
    for bad, label in (({k: v for k, v in list(want.items())[1:]}, "missing"),
                       ({**want, "no_such.weight": np.zeros(2)}, "unexpected")):
        def load(bad=bad, label=label):
            try:
                pm.load_state_dict(bad, strict=True)
            except (RuntimeError, KeyError, ValueError):
                return
            raise Mismatch(f"{what}: load_state_dict(strict=True) with a {label} key did not raise")
        agreed(world, load)


def agreed(world, fn, *args):
    """``fn(*args)`` on every rank, then agree: when it raised on any rank, every rank raises that rank's error
    (a check that fails on some ranks only must not leave the others in the next collective)."""
    err = None
    try:
        out = fn(*args)
    except Exception as e:   # noqa: BLE001
        err, out = e, None
    got = axonmpi.all_gather_object(None if err is None else (type(err).__name__, str(err)))
    bad = [(r, x) for r, x in enumerate(got) if x is not None]
    if bad:
        if err is not None:
            raise err
        r, (kind, msg) = bad[0]
        cls = {"Refused": Refused, "UnusedParameterError": UnusedParameterError}.get(kind, Mismatch)
        raise cls(f"(rank {r}) {kind}: {msg}")
    return out


def _shared_dir(world) -> str:
    path = tempfile.mkdtemp(prefix="axonmpi-fuzz-") if world.rank == 0 else None
    return axonmpi.broadcast_object(path)


def run_case(world, case: Case, checkpoint: bool = True) -> str:
    """Run ``case`` (collective over ``world``); returns ``"ok"`` or ``"refused: <reason>"``, raises
    :class:`Mismatch` (or the layout's own error) on a failure."""
    spec = case.model
    want = serial_run(spec)
    old = world.grid
    path = _shared_dir(world) if checkpoint else None
    try:
        grid = _grid(world, case.layout)
        world.grid = grid
        try:
            pm, opt = agreed(world, build, spec, case.layout, grid)
            for s in range(STEPS):
                loss, norm = train_step(spec, pm, opt, s)
                agreed(world, close, loss, want[s][0], f"step {s} loss")
                agreed(world, close, norm, want[s][1], f"step {s} clip norm")
                if checkpoint and s == STEPS - 2:
                    axonmpi.checkpoint.save(path + "/ckpt", axonmpi.checkpoint.training_state(pm, opt, step=s + 1))
            got = pm.state_dict()
            agreed(world, check_values, got, want[-1][2], f"after {STEPS} steps")
            check_strict(world, pm, want[-1][2], "state dict round trip")
            if spec.generate and generate_refusal(case.layout) is None:
                check_generate(world, spec, case.layout, pm)
        finally:
            world.grid = old
            grid.free()
        if not checkpoint:
            return "ok"
        grid = _grid(world, case.restore)
        world.grid = grid
        try:
            try:
                pm2, opt2 = agreed(world, build, spec, case.restore, grid, 7)
            except Refused as e:
                return f"ok (restore layout {e})"
            template = axonmpi.checkpoint.training_state(pm2, opt2, step=0)
            meta = axonmpi.checkpoint.restore_training_state(axonmpi.checkpoint.load(path + "/ckpt", template),
                                                             pm2, opt2)
            if meta["step"] != STEPS - 1:
                raise Mismatch(f"restored step {meta['step']}, saved {STEPS - 1}")
            loss, norm = train_step(spec, pm2, opt2, STEPS - 1)
            where = f"restored under {case.restore.short()}"
            agreed(world, close, loss, want[-1][0], f"{where}: step {STEPS - 1} loss")
            agreed(world, close, norm, want[-1][1], f"{where}: step {STEPS - 1} clip norm")
            agreed(world, check_values, pm2.state_dict(), want[-1][2], f"{where}, after step {STEPS - 1}")
        finally:
            world.grid = old
            grid.free()
        return "ok"
    finally:
        if path is not None and world.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def _names_fix(msg: str) -> bool:
    """Whether an error tells the user to build the optimizer from ``pm.parameters()`` after ``parallelize``."""
    return "build the optimizer from pm.parameters() after parallelize" in msg or "build it on pm.parameters()" in msg


def outcome(world, case: Case, checkpoint: bool = True) -> Tuple[str, Optional[str]]:
    """``(status, detail)`` agreed by every rank: ``("ok", None)``, ``("refused", reason)`` or
    ``("failed", "rank r: error")`` (collective)."""
    import traceback
    try:
        status, detail = run_case(world, case, checkpoint), None
        if status.startswith("ok ("):
            status, detail = "ok", status[4:-1]
    except Refused as e:
        status, detail = "refused", str(e).splitlines()[0]
    except UnusedParameterError as e:       # refused at the first step, the same under every layout
        status, detail = "refused", "UnusedParameterError: " + str(e).split(": ", 1)[1]
    except (RuntimeError, ValueError) as e:
        if not (case.model.opt_before and _names_fix(str(e))):
            status = "failed"
            detail = f"rank {world.rank}: {type(e).__name__}: {e}\n" + "".join(traceback.format_exc(limit=-4))
        else:       # an optimizer built before parallelize holds a parameter a layer replaced: loud, naming the fix
            status, detail = "refused", f"optimizer built before parallelize: {type(e).__name__}: {e}"
    except Exception as e:   # noqa: BLE001 - every error is a finding
        status = "failed"
        detail = f"rank {world.rank}: {type(e).__name__}: {e}\n" + "".join(traceback.format_exc(limit=-4))
    got = axonmpi.all_gather_object((status, detail))
    for st, d in got:
        if st == "failed":
            return "failed", d
    if len({st for st, _ in got}) > 1:
        return "failed", f"ranks disagree: {sorted({st for st, _ in got})}"
    return got[0]
