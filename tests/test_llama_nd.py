"""The tiny Llama under N-D layouts at 8 ranks (the ``-m nd`` pass), through its recipe (``HybridGPT`` of a
``LlamaConfig``: ``recipes/llama.py``'s plan), against the serial Llama (float64, 1e-10).

Up to four axes of data (DDP / FSDP), pipeline (ZB-H1, 1F1B, GPipe, interleaved, ZBV), Megatron tensor parallel
(fewer key/value heads than the tensor size: each head replicated over the ranks sharing it) with sequence
parallelism, AxoNN 3-D, context parallel ring (rotary at each token's global position, zig-zag order) and Ulysses,
activation checkpointing: at each of 3 AdamW steps the loss and the clip norm (clipping active), and after them
every parameter, equal the serial run.  Training state saved under one layout restores under another; a checkpoint
saved under pipeline x tensor x context parallelism exports with ``axonmpi ckpt export --format hf-llama`` to the
serial logits (``Llama.from_hf``; transformers' ``LlamaForCausalLM`` where installed).  The 1-4 rank versions are
in ``tests/test_llama_recipe.py``.
"""
import pytest

from llama_cases import (assert_stored_once, check_export, config, restore_layout,
                         run_layout, serial, shared_path)

pytestmark = pytest.mark.nd

# name: (grid sizes (G_data: what is left of 8), n_kv_head, tied, HybridGPT options)
LAYOUTS = {
    "dp2_tp4_kvrep_sp": ({"G_intra_c": 4}, 2, False, dict(tp_style="megatron", sequence_parallel=True)),
    "pp2_tp4_kvrep_zbh1": ({"G_inter": 2, "G_intra_c": 4}, 2, False,
                           dict(tp_style="megatron", schedule="zb-h1", num_microbatches=2)),
    "pp2_tp2_sp_cp2_ring_zbh1": ({"G_inter": 2, "G_intra_c": 2, "G_context": 2}, 1, False,
                                 dict(tp_style="megatron", sequence_parallel=True, cp_algo="ring", schedule="zb-h1",
                                      num_microbatches=2)),
    "fsdp2_tp2_sp_cp2_ring": ({"G_intra_c": 2, "G_context": 2}, 1, False,
                              dict(tp_style="megatron", sequence_parallel=True, cp_algo="ring", fsdp="full_shard")),
    "dp2_tp2_cp2_ulysses": ({"G_intra_c": 2, "G_context": 2}, 2, False, dict(tp_style="megatron", cp_algo="ulysses")),
    "fsdp2_pp2_tp2_1f1b_tied": ({"G_inter": 2, "G_intra_c": 2}, 2, True,
                                dict(tp_style="megatron", fsdp="full_shard", schedule="1f1b", num_microbatches=2)),
    "dp2_pp2_axonn2_gpipe": ({"G_inter": 2, "G_intra_r": 2}, 2, False,
                             dict(tp_style="axonn", schedule="gpipe", num_microbatches=2)),
    "dp2_pp2_cp2_ring_interleaved_ac": ({"G_inter": 2, "G_context": 2}, 2, False,
                                        dict(cp_algo="ring", schedule="interleaved", num_microbatches=2,
                                             activation_checkpointing=True)),
    "fsdp2_sgo_pp2_cp2_ulysses_zbv": ({"G_inter": 2, "G_context": 2}, 2, True,
                                      dict(cp_algo="ulysses", fsdp="shard_grad_op", schedule="zbv",
                                           num_microbatches=2)),
    "dp4_tp2_kvrep_sp_ac": ({"G_intra_c": 2}, 1, False,
                            dict(tp_style="megatron", sequence_parallel=True, activation_checkpointing=True)),
}


def _layout(world, name):
    if world.world_size != 8:
        pytest.skip("the Llama's N-D layouts are laid out for 8 ranks")
    sizes, kv, tied, opts = LAYOUTS[name]
    return sizes, config(kv, tied), opts


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llama_nd_layout_matches_serial(world, name):
    sizes, cfg, opts = _layout(world, name)
    run_layout(world, name, sizes, cfg, opts)


PAIRS = [("pp2_tp4_kvrep_zbh1", "dp2_tp2_cp2_ulysses"), ("pp2_tp2_sp_cp2_ring_zbh1", "dp4_tp2_kvrep_sp_ac"),
         ("fsdp2_tp2_sp_cp2_ring", "pp2_tp2_sp_cp2_ring_zbh1"), ("fsdp2_pp2_tp2_1f1b_tied", "dp2_pp2_axonn2_gpipe")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("saved,restored", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_llama_nd_checkpoint_restores_under_another_layout(world, saved, restored, tmp_path_factory):
    sizes, cfg, opts = _layout(world, saved)
    sizes2, _, opts2 = _layout(world, restored)          # the saved layout's model
    path = shared_path(world, tmp_path_factory, "llama-nd-ckpt")
    run_layout(world, saved, sizes, cfg, opts, save=path)
    assert_stored_once(world, path)
    restore_layout(world, restored, sizes2, cfg, opts2, path)


@pytest.mark.mpi(min_size=8)
def test_ckpt_export_hf_llama_from_a_three_axis_layout(world, tmp_path_factory):
    """Saved under pipeline x tensor (sequence parallel, one key/value head replicated) x context (ring)."""
    name = "pp2_tp2_sp_cp2_ring_zbh1"
    sizes, cfg, opts = _layout(world, name)
    path = shared_path(world, tmp_path_factory, "llama-nd-export")
    run_layout(world, name, sizes, cfg, opts, save=path)
    check_export(world, path, cfg, serial(cfg)[-2][2])
