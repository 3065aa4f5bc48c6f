"""MoE in the GPT: config, HybridGPT with expert parallelism against the serial GPT, train_gpt flags and metrics."""
import json
import os
import sys

import numpy as np
import pytest

import axonmpi
from axonmpi.models import GPT, GPTConfig
from axonmpi.nn import MoE
from axonmpi.recipes import HybridGPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def _cfg(**kw):
    c = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, moe_experts=4, moe_top_k=2)
    c.update(kw)
    return GPTConfig(**c)


def _batch(step, rows):
    rng = np.random.default_rng(50 + step)
    return rng.integers(0, 11, (rows, 8)), rng.integers(0, 11, (rows, 8))


def test_gpt_config_places_moe_blocks():
    axonmpi.manual_seed(0)
    g = GPT(_cfg(moe_every=2), dtype=np.float64)
    assert not isinstance(g.blocks[0].mlp, MoE) and isinstance(g.blocks[1].mlp, MoE)
    keys = g.state_dict().keys()
    assert "blocks.1.mlp.router.weight" in keys and "blocks.1.mlp.experts.fc.weight" in keys
    x, y = _batch(0, 3)
    _, loss = g(x, y)
    (loss + g.moe_auxiliary_loss()).backward()
    assert g.blocks[1].mlp.router.weight.grad is not None
    assert GPT(_cfg(moe_experts=0)).moe_auxiliary_loss() is None
    with pytest.raises(ValueError, match="moe_top_k"):
        _cfg(moe_top_k=3)
    with pytest.raises(ValueError, match="moe_every"):
        _cfg(moe_every=3)


@pytest.mark.mpi(min_size=2)
def test_hybrid_gpt_expert_parallel_equals_serial():
    world = axonmpi.init()
    n = world.world_size
    for ep in sorted({d for d in (n, 2) if n % d == 0}):
        grid = axonmpi.ProcessGrid(world, expert_parallel=ep)
        cfg = _cfg(moe_experts=2 * ep)
        axonmpi.manual_seed(0)
        ref = GPT(cfg, dtype=np.float64)
        axonmpi.manual_seed(0)
        hyb = HybridGPT(cfg, grid, dtype="float64", global_batch=2 * n, expert_parallel=ep)
        assert hyb.model.blocks[0].mlp.experts.fc.weight.data.shape[0] == 2
        o_ref = axonmpi.optim.AdamW(ref.parameters(), lr=0.02, weight_decay=0.1)
        o_hyb = axonmpi.optim.AdamW(hyb.parameters(), lr=0.02, weight_decay=0.1)
        for step in range(3):
            x, y = _batch(step, 2 * n)
            o_ref.zero_grad()
            _, loss = ref(x, y)
            (loss + ref.moe_auxiliary_loss()).backward()
            axonmpi.optim.clip_grad_norm_(ref.parameters(), 0.1)
            o_ref.step()
            o_hyb.zero_grad()
            got = hyb.forward_backward(hyb.local_batch(x), hyb.local_batch(y))
            hyb.clip_grad_norm_(0.1)
            o_hyb.step()
            want = float(loss.data)
            assert abs(got - want) <= 1e-10 * abs(want), (ep, step, got, want)
        full = hyb.full_state_dict() if hasattr(hyb, "full_state_dict") else None
        if full is not None:
            for k, v in ref.state_dict().items():
                np.testing.assert_allclose(full[k], v, rtol=1e-9, atol=1e-12, err_msg=k)
        grid.free()


@pytest.mark.mpi(min_size=2)
def test_train_gpt_moe_flags_and_metrics(tmp_path_factory):
    import train_gpt
    world = axonmpi.init()
    n = world.world_size
    d = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("moegpt")) if world.rank == 0 else None)
    ep = 2 if n % 2 == 0 else n
    metrics = os.path.join(d, "m.json")
    train_gpt.main(["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "8", "--corpus-bytes",
                    "20000", "--eval-batches", "1", "--no-progress", "--steps", "3", "--global-batch", str(2 * n),
                    "--checkpoint-dir", os.path.join(d, "ck"), "--sample-chars", "3", "--metrics-json", metrics,
                    "--moe-experts", str(2 * ep), "--moe-top-k", "2", "--expert-parallel", str(ep),
                    "--moe-every", "2"])
    axonmpi.barrier()
    rows = [json.loads(line) for line in open(metrics)]
    assert [r["step"] for r in rows] == [1, 2, 3]
    tokens = 2 * n * 8 * 2          # global batch x sequence x top-k, one MoE layer
    for r in rows:
        assert {"loss", "aux_loss", "z_loss", "tokens_per_expert_min", "tokens_per_expert_mean",
                "tokens_per_expert_max", "dropped_tokens"} <= set(r)
        assert r["dropped_tokens"] == 0 and r["tokens_per_expert_mean"] * 2 * ep == tokens
        assert r["tokens_per_expert_min"] <= r["tokens_per_expert_mean"] <= r["tokens_per_expert_max"]
