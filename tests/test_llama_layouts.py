"""The tiny Llama under the public ``axonmpi.parallel.parallelize`` against the serial model (float64).

A Megatron plan on transformers' names (q/k/v and gate/up column-parallel, o/down row-parallel, the
embedding vocabulary-parallel, ``lm_head`` column-parallel with its output gathered) splits query
and key/value heads alike: each rank reads its heads from the projected widths, so the model needs no
tensor-parallel layer of its own (the tensor size divides ``n_kv_head``).  DDP, FSDP, TP and TP x DDP /
TP x FSDP, AxoNN 3-D (easy mode: every Linear; 2 rows, or 2 columns x 2 depth) and DDP with every
decoder layer recomputed in backward, at 2, 3 and 4 ranks, untied and tied heads: the loss (``pm.token_mean``) and the clip norm
(clipping active) at each of 3 AdamW steps and the parameters after equal the serial run to 1e-10.

Phase 2 of issue 42 (the Llama recipe: fewer kv heads than the tensor size, sequence and context parallelism
with rotary positions, pipelines) is tested in ``tests/test_llama_recipe.py`` and ``tests/test_llama_nd.py``.
"""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn.functional as F
from axonmpi.models import Llama, LlamaConfig
from axonmpi.models.llama import LlamaDecoderLayer
from axonmpi.optim import AdamW
from axonmpi.optim.clip import clip_grad_norm_
from axonmpi.parallel import full_state_dict, parallelize

TOL = 1e-10
GB, T, V = 12, 8, 48
STEPS = 3
MAX_NORM = 0.5
PLAN = {"*.q_proj": "column", "*.k_proj": "column", "*.v_proj": "column", "*.o_proj": "row",
        "*.gate_proj": "column", "*.up_proj": "column", "*.down_proj": "row",
        "model.embed_tokens": "vocab", "lm_head": "column_gather"}
# name: (grid sizes at world size p or None when the layout does not fit, tensor plan, data parallel)
LAYOUTS = {
    "ddp": (lambda p: {}, None, "ddp"),
    "fsdp": (lambda p: {}, None, "fsdp"),
    "tp": (lambda p: {"G_intra_c": p} if p in (2, 4) else None, PLAN, "ddp"),
    "tp2_x_ddp": (lambda p: {"G_intra_c": 2} if p == 4 else None, PLAN, "ddp"),
    "tp2_x_fsdp": (lambda p: {"G_intra_c": 2} if p in (2, 4) else None, PLAN, "fsdp"),
    "axonn_2row": (lambda p: {"G_intra_r": 2} if p in (2, 4) else None, "axonn", "ddp"),
    "axonn_2col_2depth": (lambda p: {"G_intra_c": 2, "G_intra_d": 2} if p == 4 else None, "axonn", "ddp"),
    "ddp_recompute": (lambda p: {}, None, "ddp"),
}


def _config(tied):
    # 8 query heads over 4 key/value heads of width 4: a tensor size of 2 or 4 splits both
    return LlamaConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=8, n_kv_head=4, intermediate_size=40,
                       block_size=16, rope_theta=50.0, rms_norm_eps=1e-5, tie_word_embeddings=tied)


def _make(tied):
    axonmpi.manual_seed(5)
    model = Llama(_config(tied), dtype=np.float64)
    rng = np.random.default_rng(5)
    with axonmpi.no_grad():        # norms start at one: move them so their gradients show
        for p in model.parameters():
            p.data[...] += 0.05 * rng.standard_normal(p.shape)
    return model


def _batch(step):
    rng = np.random.default_rng(100 + step)
    return rng.integers(0, V, (GB, T)), rng.integers(0, V, (GB, T))


def _close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300)
    assert err <= TOL, f"{what}: relative error {err:.3g}"
    return err


def _serial(tied):
    ref = _make(tied)
    opt = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms = [], []
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        _, loss = ref(x, y)
        loss.backward()
        norms.append(clip_grad_norm_(ref.parameters(), MAX_NORM))
        opt.step()
        losses.append(loss.item())
    assert min(norms) > MAX_NORM       # clipping is active at every step
    return losses, norms, ref.state_dict()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_under_parallelize_matches_serial(world, layout, tied):
    sizes, plan, dp = LAYOUTS[layout]
    sizes = sizes(world.world_size)
    if sizes is None:
        pytest.skip(f"{layout} is laid out at other world sizes")
    want_losses, want_norms, want = _serial(tied)
    grid = axonmpi.ProcessGrid(world, **sizes)
    try:
        # FSDP units: one per decoder layer (torchtitan's); the embedding and the head (tied or not) in the root
        # unit (the default policy makes each a unit of its own and refuses a tied head, naming this fix)
        options = {"auto_wrap_policy": {LlamaDecoderLayer}} if dp == "fsdp" else {}
        if layout.endswith("recompute"):     # every decoder layer recomputes its forward in backward
            options["activation_checkpointing"] = ["model.layers.*"]
        pm = parallelize(_make(tied), grid=grid, tensor_parallel=plan, data_parallel=dp, **options)
        opt = AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
        worst = 0.0
        for s in range(STEPS):
            xb, yb = pm.local_batch(*_batch(s))
            opt.zero_grad()
            logits, _ = pm(xb)
            lsum = F.cross_entropy(logits, yb, reduction="sum")
            loss = pm.token_mean(lsum, num_tokens=int(yb.size))
            loss.backward()
            norm = clip_grad_norm_(pm.parameters(), MAX_NORM)
            opt.step()
            worst = max(worst, _close(loss.item(), want_losses[s], f"{layout} step {s} loss"),
                        _close(norm, want_norms[s], f"{layout} step {s} clip norm"))
        got = full_state_dict(pm)
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        for k in want:
            worst = max(worst, _close(got[k], want[k], f"{layout} after {STEPS} steps: {k}"))
        if world.rank == 0:
            print(f"\nparity llama/{layout}/{'tied' if tied else 'untied'} at {world.world_size} ranks: "
                  f"worst relative error {worst:.2e}")
    finally:
        grid.free()


@pytest.mark.mpi(min_size=4)
def test_fewer_kv_heads_than_the_tensor_size_raises_naming_the_rule(world):
    """2 key/value heads over a tensor size of 4 under a plain ``"column"`` plan would cut a head in two: every rank
    raises at the first forward, naming the rule (the recipe's ``"column_kv"`` replicates each head instead)."""
    if world.world_size != 4:
        pytest.skip("the layout is for 4 ranks")
    axonmpi.manual_seed(5)
    cfg = LlamaConfig(vocab_size=V, n_embd=32, n_layer=1, n_head=8, n_kv_head=2, intermediate_size=40, block_size=16)
    grid = axonmpi.ProcessGrid(world, G_intra_c=4)
    try:
        pm = parallelize(Llama(cfg, dtype=np.float64), grid=grid, tensor_parallel=PLAN, data_parallel="ddp")
        xb, _ = pm.local_batch(*_batch(0))
        with pytest.raises(ValueError, match=r"k_proj gives 2 features on this rank.*n_kv_head=2"):
            pm(xb)
    finally:
        grid.free()


@pytest.mark.mpi(min_size=2)
def test_sequence_parallel_without_the_llama_region_fails_loudly(world):
    """Sequence parallelism without the Llama's model plan (``recipes.llama.llama_model_plan``: the region entered
    after the embedding) scatters the token ids, so the rotary tables would cover this rank's tokens only while
    the gathered projections see the whole sequence: it raises at the first forward rather than rotate wrongly."""
    if world.world_size != 2:
        pytest.skip("the layout is for 2 ranks")
    grid = axonmpi.ProcessGrid(world, G_intra_c=2)
    try:
        pm = parallelize(_make(False), grid=grid, tensor_parallel=PLAN, sequence_parallel=True, data_parallel="ddp")
        xb, _ = pm.local_batch(*_batch(0))
        with pytest.raises(ValueError, match="position_embeddings of shape .* do not cover the 8 tokens"):
            pm(xb)
    finally:
        grid.free()
