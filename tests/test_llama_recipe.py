"""The Llama recipe (``recipes/llama.py``) under the composer at 1-4 ranks, against the serial Llama (float64).

Layouts at 2, 3 and 4 ranks through ``HybridGPT`` of a ``LlamaConfig``: Megatron TP with fewer key/value heads
than the tensor size (each head replicated over the ranks sharing it, ``"column_kv"``), sequence parallelism
(the region entered at the embedding, rotary tables of the whole sequence), context parallelism ring (zig-zag,
uneven at 3 ranks) and Ulysses (multi-query: the key/value head repeated over the context ranks) with rotary
at global positions, pipelines (ZB-H1, 1F1B, tied head across stages), FSDP, AxoNN with recomputation: the loss
and the clip norm of 3 AdamW steps (clipping active) and every parameter after equal the serial run to 1e-10.
Training state saved under one layout restores under another (``ShardedState``: each block once) and
``axonmpi ckpt export --format hf-llama`` of it loads into ``Llama.from_hf`` (and transformers'
``LlamaForCausalLM`` where installed) with the serial logits.  The positions the attention sees are checked
directly, and the refusals name their fix.  The 8-rank layouts are in ``tests/test_llama_nd.py``.
"""
import numpy as np
import pytest

import axonmpi
from axonmpi.models import Llama
from axonmpi.parallel import parallelize
from axonmpi.parallel.context import ContextLayout, grouped_causal_attention, ring_attention
from axonmpi.recipes.llama import llama_model_plan, llama_plan

from llama_cases import (GB, assert_stored_once, check_export, config, restore_layout,
                         run_layout, serial, shared_path)

# name: (world size, grid sizes (G_data: what is left), n_kv_head, tied, HybridGPT options)
LAYOUTS = {
    "tp2_mqa_sp": (2, {"G_intra_c": 2}, 1, False, dict(tp_style="megatron", sequence_parallel=True)),
    "cp2_ring": (2, {"G_context": 2}, 2, False, dict(cp_algo="ring")),
    "cp2_ulysses_mqa": (2, {"G_context": 2}, 1, False, dict(cp_algo="ulysses")),
    "pp2_zbh1_tied": (2, {"G_inter": 2}, 2, True, dict(schedule="zb-h1", num_microbatches=2)),
    "fsdp2": (2, {}, 2, False, dict(fsdp="full_shard")),
    "cp3_ring_uneven": (3, {"G_context": 3}, 2, False, dict(cp_algo="ring")),
    "tp4_kvrep_sp": (4, {"G_intra_c": 4}, 2, False, dict(tp_style="megatron", sequence_parallel=True)),
    "tp2_cp2_ring_sp_mqa": (4, {"G_intra_c": 2, "G_context": 2}, 1, False,
                            dict(tp_style="megatron", sequence_parallel=True, cp_algo="ring")),
    "pp2_tp2_kvrep_zbh1": (4, {"G_inter": 2, "G_intra_c": 2}, 1, False,
                           dict(tp_style="megatron", schedule="zb-h1", num_microbatches=2)),
    "fsdp2_tp2_kvrep_tied": (4, {"G_intra_c": 2}, 1, True, dict(tp_style="megatron", fsdp="full_shard")),
    "pp2_cp2_ulysses_1f1b": (4, {"G_inter": 2, "G_context": 2}, 2, False,
                             dict(cp_algo="ulysses", schedule="1f1b", num_microbatches=2)),
    "dp2_axonn2_ac": (4, {"G_intra_c": 2}, 2, False, dict(tp_style="axonn", activation_checkpointing=True)),
}


def _layout(world, name):
    n, sizes, kv, tied, opts = LAYOUTS[name]
    if world.world_size != n:
        pytest.skip(f"{name} is laid out for {n} ranks")
    return sizes, config(kv, tied), opts


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llama_layout_matches_serial(world, name):
    sizes, cfg, opts = _layout(world, name)
    run_layout(world, name, sizes, cfg, opts)


# (saved, restored): the same config, another layout
PAIRS = [("tp2_mqa_sp", "cp2_ulysses_mqa"), ("pp2_zbh1_tied", "fsdp2"),
         ("pp2_tp2_kvrep_zbh1", "tp2_cp2_ring_sp_mqa"), ("tp4_kvrep_sp", "pp2_cp2_ulysses_1f1b")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("saved,restored", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_llama_checkpoint_restores_under_another_layout(world, saved, restored, tmp_path_factory):
    """Training state (the model's and AdamW's, sharded) saved after 2 steps under ``saved`` -- each serial element
    stored once, replicated key/value heads included -- restores under ``restored`` built from other weights,
    whose third step and parameters equal the serial run's."""
    sizes, cfg, opts = _layout(world, saved)
    sizes2, _, opts2 = _layout(world, restored)          # the saved layout's model (head tied or not)
    path = shared_path(world, tmp_path_factory, "llama-ckpt")
    run_layout(world, saved, sizes, cfg, opts, save=path)
    assert_stored_once(world, path)
    restore_layout(world, restored, sizes2, cfg, opts2, path)


@pytest.mark.mpi(min_size=2)
def test_ckpt_export_hf_llama_from_a_two_axis_layout(world, tmp_path_factory):
    """A checkpoint saved under pipeline x tensor parallel (replicated key/value heads) exports with
    ``axonmpi ckpt export --format hf-llama``: ``Llama.from_hf`` gives the serial model's logits exactly,
    transformers' ``LlamaForCausalLM.from_pretrained`` to 1e-5 in float32 (where installed)."""
    if world.world_size != 4:
        pytest.skip("saved under the 4-rank pp2_tp2_kvrep_zbh1 layout")
    sizes, cfg, opts = _layout(world, "pp2_tp2_kvrep_zbh1")
    path = shared_path(world, tmp_path_factory, "llama-export")
    run_layout(world, "pp2_tp2_kvrep_zbh1", sizes, cfg, opts, save=path)
    check_export(world, path, cfg, serial(cfg)[-2][2])


# -- what the attention sees -------------------------------------------------------------------------
@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("piped", [False, True], ids=["whole", "pipeline"])
def test_rotary_positions_under_sequence_and_context_parallelism(world, piped):
    """Under tensor x context parallelism with sequence parallelism (the region declared: entered at the
    embedding), the rotary tables are of this rank's tokens' global positions -- the ring's zig-zag chunks --
    whole over the tensor group (the attention's column layers gather the sequence), not of its shard; in a
    pipeline each stage's block numbers them itself."""
    if world.world_size != 4:
        pytest.skip("tensor 2 x context 2")
    from axonmpi.models.llama import LlamaBlock
    from axonmpi.nn.rotary import RotaryEmbedding
    cfg = config(1)
    seen = []
    forward = RotaryEmbedding.forward

    def record(self, x, positions=None):
        seen.append(None if positions is None else np.asarray(positions).copy())
        return forward(self, x, positions)
    RotaryEmbedding.forward = record
    old, grid = world.grid, axonmpi.ProcessGrid(world, G_intra_c=2, G_context=2)
    try:
        world.grid = grid
        axonmpi.manual_seed(7)
        pm = parallelize(Llama(cfg, dtype=np.float64), grid=grid, tensor_parallel=llama_plan(cfg, 2, True),
                         sequence_parallel=True, context_parallel="ring", model_plan=llama_model_plan(cfg))
        x, _ = pm.local_batch(*_batch16())
        if piped:            # the blocks as a pipeline stage runs them: each on its sequence shard
            from axonmpi.parallel.axes.context import number_layer_positions
            layers = Llama.pipeline_layers(pm.inner)
            number_layer_positions(layers, pm.composition, first_is_input=True)
            h = layers[0](x)                     # the embedding's output, scattered over the tensor group
            assert h.shape[1] == x.shape[1] // 2
            assert isinstance(layers[1], LlamaBlock)
            layers[1](h)
        else:
            pm(x)
        want = ContextLayout(16, 2, "ring").positions(grid.context_group.rank)
        assert len(seen) == 1 and np.array_equal(seen[0], want), (seen, want)
    finally:
        RotaryEmbedding.forward = forward
        world.grid = old
        grid.free()


def _batch16():
    rng = np.random.default_rng(0)
    return rng.integers(0, 48, (GB, 16)), rng.integers(0, 48, (GB, 16))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kv", [1, 2, 4])
def test_ring_attention_with_grouped_heads_equals_serial(world, kv):
    """``ring_attention`` with fewer key/value heads than query heads (only those travel) equals serial
    grouped-query causal attention, values and gradients, at 1-4 ranks (11 tokens: uneven chunks)."""
    from axonmpi import Tensor
    n, p = 11, world.world_size
    if 2 * p > n:
        pytest.skip("at least one token per chunk")
    rng = np.random.default_rng(kv)
    q, k, v = rng.standard_normal((2, 4, n, 3)), rng.standard_normal((2, kv, n, 3)), rng.standard_normal((2, kv, n, 3))
    dy = rng.standard_normal((2, 4, n, 3))
    ts = [Tensor(a, requires_grad=True) for a in (q, k, v)]
    (grouped_causal_attention(*ts) * Tensor(dy)).sum().backward()
    lay, g, r = ContextLayout(n, p, "ring"), world.default_group, world.rank
    loc = [Tensor(lay.split(a, r, axis=2), requires_grad=True) for a in (q, k, v)]
    y = ring_attention(*loc, g, n)
    (y * Tensor(lay.split(dy, r, axis=2))).sum().backward()
    np.testing.assert_allclose(y.numpy(), lay.split(grouped_causal_attention(*[Tensor(a) for a in (q, k, v)]).numpy(),
                                                    r, axis=2), rtol=0, atol=1e-12)
    for t, full in zip(loc, ts):
        np.testing.assert_allclose(t.grad.numpy(), lay.split(full.grad.numpy(), r, axis=2), rtol=0, atol=1e-12)


# -- refusals ------------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_refusals_name_the_fix(world):
    """Key/value heads that neither divide nor are divided by the tensor size, ``"column_kv"`` on a Linear that is
    no grouped-query attention's key/value projection, and sequence parallelism over an attention left out of the
    plan, each raise on every rank naming the rule."""
    if world.world_size != 2:
        pytest.skip("2 tensor ranks")
    from axonmpi.models import LlamaConfig
    grid = axonmpi.ProcessGrid(world, G_intra_c=2)
    try:
        cfg3 = LlamaConfig(vocab_size=48, n_embd=24, n_layer=1, n_head=6, n_kv_head=3, intermediate_size=40)
        with pytest.raises(ValueError, match=r"3 key/value heads over a tensor group of 2"):
            parallelize(Llama(cfg3, dtype=np.float64), grid=grid, tensor_parallel=llama_plan(cfg3, 2))
        cfg = config(2)
        with pytest.raises(TypeError, match="'column_kv' pattern, which splits the key/value heads"):
            parallelize(Llama(cfg, dtype=np.float64), grid=grid, tensor_parallel={"*.q_proj": "column_kv"})
        with pytest.raises(ValueError, match="k_proj / v_proj 'column_kv'"):
            parallelize(Llama(cfg, dtype=np.float64), grid=grid, tensor_parallel={"*.gate_proj": "column",
                        "*.up_proj": "column", "*.down_proj": "row", "lm_head": "column_gather"},
                        sequence_parallel=True, model_plan=llama_model_plan(cfg))
    finally:
        grid.free()
    from axonmpi.recipes.gpt_layout import check_layout
    from axonmpi.distributed.grid import Layout
    with pytest.raises(ValueError, match=r"n_kv_head=3 neither divides by G_intra_c=2"):
        check_layout(cfg3, Layout(G_intra_c=2), global_batch=4, tp_style="megatron")
