"""The tiny Llama's serial-vs-layout harness, shared by ``tests/test_llama_recipe.py`` (1-4 ranks) and
``tests/test_llama_nd.py`` (8 ranks).

:func:`run_layout` trains the Llama three AdamW steps (weight decay, clipping active at every step) under a
layout through the recipe (``HybridGPT`` of a ``LlamaConfig``: ``recipes/llama.py``'s plan) and checks, at
1e-10 relative in float64, the loss (the global token mean, some targets ignored) and the clip norm of every
step against one process on the global batch, then every parameter.  With ``save`` it writes the training
state after two steps (the model's and AdamW's sharded state); :func:`restore_layout` reads it under another
layout (other weights first) and checks the third step and the parameters after it.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

import axonmpi
import axonmpi.nn.functional as F
from axonmpi import checkpoint as ckpt
from axonmpi.checkpoint import cli as ckpt_cli
from axonmpi.interop import EXPORT_FORMATS
from axonmpi.models import Llama, LlamaConfig
from axonmpi.optim import AdamW
from axonmpi.optim.clip import clip_grad_norm_
from axonmpi.recipes import HybridGPT

TOL = 1e-10
V, T, GB = 48, 8, 16
STEPS = 3
MAX_NORM = 0.05
LR, WD = 1e-2, 0.1


def config(n_kv_head: int = 2, tied: bool = False) -> LlamaConfig:
    """8 query heads of width 4 over ``n_kv_head`` key/value heads; rotary base 50 (every pair turns visibly)."""
    return LlamaConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=8, n_kv_head=n_kv_head, intermediate_size=40,
                       block_size=16, rope_theta=50.0, rms_norm_eps=1e-5, tie_word_embeddings=tied)


def batch(step: int) -> Tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s global batch: token ids and targets, some ``-100`` (not counted), unevenly over the rows."""
    rng = np.random.default_rng(100 + step)
    x, y = rng.integers(0, V, (GB, T)), rng.integers(0, V, (GB, T))
    y[: 2 + step, : 3 + step] = -100
    return x, y


def close(got, want, what: str) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, serial {want.shape}"
    err = float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-300)
    assert err <= TOL, f"{what}: relative error {err:.3g}"
    return err


_SERIAL: Dict[LlamaConfig, List[Tuple[float, float, Dict[str, np.ndarray]]]] = {}


def serial(cfg: LlamaConfig):
    """``[(loss, clip norm, state dict after the step)]`` of the plain Llama over :data:`STEPS` steps (cached)."""
    if cfg not in _SERIAL:
        axonmpi.manual_seed(7)
        model = Llama(cfg, dtype=np.float64)
        opt = AdamW(model.parameters(), lr=LR, weight_decay=WD)
        out = []
        for s in range(STEPS):
            x, y = batch(s)
            opt.zero_grad()
            logits, _ = model(x)
            loss = F.cross_entropy(logits, y, ignore_index=-100)
            loss.backward()
            norm = float(clip_grad_norm_(model.parameters(), MAX_NORM))
            opt.step()
            out.append((float(loss.item()), norm, {k: np.array(v, copy=True) for k, v in model.state_dict().items()}))
        assert min(n for _, n, _ in out) > MAX_NORM            # clipping is active at every step
        _SERIAL[cfg] = out
    return _SERIAL[cfg]


def build(world, sizes: dict, cfg: LlamaConfig, opts: dict, seed: int = 7):
    """``(grid, HybridGPT, AdamW)`` of the Llama under ``sizes`` (``G_data``: what is left) and the recipe's
    options; the world's current grid is the new one until :func:`release`."""
    grid = axonmpi.ProcessGrid(world, **sizes)
    world.grid = grid
    axonmpi.manual_seed(seed)
    hyb = HybridGPT(cfg, grid, dtype="float64", global_batch=GB, **opts)
    return grid, hyb, AdamW(hyb.parameters(), lr=LR, weight_decay=WD)


def release(world, grid, old) -> None:
    world.grid = old
    grid.free()


def step(hyb, opt, s: int) -> Tuple[float, float]:
    x, y = batch(s)
    opt.zero_grad()
    loss = hyb.forward_backward(hyb.local_batch(x), hyb.local_batch(y))
    norm = hyb.clip_grad_norm_(MAX_NORM)
    opt.step()
    return loss, norm


def run_layout(world, name: str, sizes: dict, cfg: LlamaConfig, opts: dict, save: Optional[str] = None) -> float:
    """Train :data:`STEPS` steps under the layout, each equal to the serial run; with ``save`` write the training
    state after ``STEPS - 1`` steps there.  Returns the worst relative error."""
    want = serial(cfg)
    old = world.grid
    grid, hyb, opt = build(world, sizes, cfg, opts)
    try:
        worst = 0.0
        for s in range(STEPS):
            loss, norm = step(hyb, opt, s)
            worst = max(worst, close(loss, want[s][0], f"{name} step {s} loss"),
                        close(norm, want[s][1], f"{name} step {s} clip norm"))
            if save is not None and s == STEPS - 2:
                model, optim = hyb.checkpoint_state(opt)
                ckpt.save(save, ckpt.training_state(model, optim, step=s + 1,
                                                    extra={"config": cfg.to_dict(), "layout": hyb.layout_record()}))
        got = hyb.full_state_dict()
        assert sorted(got) == sorted(want[-1][2]), sorted(set(got) ^ set(want[-1][2]))
        for k, v in want[-1][2].items():
            worst = max(worst, close(got[k], v, f"{name} after {STEPS} steps: {k}"))
        if world.rank == 0:
            print(f"\nllama/{name} at {world.world_size} ranks: worst relative error {worst:.2e}")
        return worst
    finally:
        release(world, grid, old)


def restore_layout(world, name: str, sizes: dict, cfg: LlamaConfig, opts: dict, path: str) -> None:
    """Build the layout from other weights, restore the training state saved at ``path`` (under any layout: each
    rank reads its blocks), and check that its step ``STEPS - 1`` and the parameters after equal the serial run."""
    want = serial(cfg)
    old = world.grid
    grid, hyb, opt = build(world, sizes, cfg, opts, seed=99)
    try:
        model, optim = hyb.checkpoint_state(opt)
        template = ckpt.training_state(model, optim, step=0, extra={})   # this layout's blocks: each rank reads its own
        meta = ckpt.restore_training_state(ckpt.load(path, template), model, optim)
        assert int(meta["step"]) == STEPS - 1
        before = hyb.full_state_dict()
        for k, v in want[-2][2].items():
            close(before[k], v, f"restored under {name}: {k}")
        loss, norm = step(hyb, opt, STEPS - 1)
        close(loss, want[-1][0], f"restored under {name}: step {STEPS - 1} loss")
        close(norm, want[-1][1], f"restored under {name}: step {STEPS - 1} clip norm")
        got = hyb.full_state_dict()
        for k, v in want[-1][2].items():
            close(got[k], v, f"restored under {name}, after step {STEPS - 1}: {k}")
    finally:
        release(world, grid, old)


def shared_path(world, tmp_path_factory, name: str) -> str:
    """A folder every rank sees (rank 0 makes it), and a checkpoint path in it."""
    base = str(tmp_path_factory.mktemp(name)) if world.rank == 0 else None
    return axonmpi.broadcast_object(base) + "/ckpt"


def check_export(world, path, cfg, state):
    """Rank 0 exports the checkpoint at ``path`` and compares the logits with the plain Llama holding ``state`` (the
    serial run's, which the layout's equal to 1e-10)."""
    if world.rank == 0:
        out = path + "-hf"
        assert ckpt_cli.main(["export", path, out, "--format", "hf-llama"], formats=EXPORT_FORMATS) == 0
        plain = Llama(cfg, dtype=np.float64)
        plain.load_state_dict(state)
        idx = np.random.default_rng(3).integers(0, cfg.vocab_size, (3, T))
        with axonmpi.no_grad():
            want = plain(idx)[0].numpy()
            back = Llama.from_hf(out)
            assert back.config == cfg
            close(back(idx)[0].numpy(), want, "Llama.from_hf of the export: logits")      # the layout's weights
        try:
            import torch
            import transformers
        except ImportError:
            pass
        else:
            hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            with torch.no_grad():
                theirs = hf(torch.from_numpy(idx)).logits.numpy()
            err = np.max(np.abs(theirs - want)) / max(1.0, np.max(np.abs(want)))
            assert err <= 1e-5, f"transformers' logits of the export: relative difference {err:.3g}"
    axonmpi.barrier()


def assert_stored_once(world, path: str, names=("model/model.layers.0.self_attn.k_proj.weight",
                                          "optimizer/state/model.layers.0.self_attn.v_proj.weight/exp_avg")) -> None:
    """Each serial element of ``names`` is stored exactly once in the checkpoint at ``path`` (replicated key/value
    heads: the ranks sharing a head hold equal blocks, written by one of them).  Rank 0 reads; every rank raises."""
    from axonmpi.checkpoint import CheckpointReader
    problem = None
    if world.rank == 0:
        reader = CheckpointReader(path)
        for name in names:
            e = reader.entry(name)
            count = np.zeros(e.full_shape, np.int64)
            for piece in e.pieces:
                count[piece.slices] += 1
            if not (count == 1).all():
                problem = f"{name}: elements stored {sorted(set(count.ravel().tolist()))} times"
    problem = axonmpi.broadcast_object(problem)
    assert problem is None, problem

