"""The AxoNN porting table of docs/tensor_parallel.md: every axonmpi name in it imports, and every
AxoNN public name (read from AxoNN's source at commit 660a224) has a row."""
import os

import pytest

from axonmpi.testing.doc_tables import axonmpi_names, resolve, table_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADING = "### Every AxoNN public name"

# The public names of axonn-ai/axonn at 660a224: axonn/axonn.py (functions and module state), the
# communication handle's attributes and methods, axonn/config.py, axonn.intra_layer's exports,
# axonn/inter_layer.py, axonn/optim.py, axonn/checkpoint.py, axonn/timers.py, axonn/lightning,
# axonn/models/transformers.
AXONN_NAMES = [
    "axonn.axonn.init", "axonn.axonn.create_dataloader", "axonn.axonn.get_timers", "axonn.axonn.is_initialized",
    "axonn.axonn.comm_handle", "enable_internal_timers", "gpus_per_node",
    "data_parallel_group", "coll_nccl_comm", "inner_intra_layer_parallel_group", "outer_intra_layer_parallel_group",
    "depth_intra_layer_parallel_group", "intra_layer_group", "p2p_mpi_comm", "get_intra_layer_groups",
    "world_rank", "world_size", "local_rank", "data_parallel_rank", "inter_layer_parallel_rank",
    "intra_layer_parallel_rank", "intra_layer_depth_parallel_rank", "intra_layer_row_parallel_rank",
    "intra_layer_column_parallel_rank", "G_inter", "G_data", "G_intra", "G_intra_r", "G_intra_c", "G_intra_d",
    "comm_handle.send", "comm_handle.recv", "comm_handle.allreduce", "comm_handle.broadcast_inter_layer",
    "axonn.config", "micro_batch_size", "batch_size",
    "axonn.intra_layer.Linear", "axonn.intra_layer.Embedding", "axonn.intra_layer.Conv2d",
    "axonn.intra_layer.Drop", "axonn.intra_layer.Gather", "axonn.intra_layer.clip_grad_norm_",
    "axonn.intra_layer.auto_parallelize", "axonn.intra_layer.optimize_communication",
    "axonn.intra_layer.overlap_all_gathers_for_checkpointed_forward", "axonn.intra_layer.no_grad_sync",
    "axonn.intra_layer.NO_GRADIENT_SYNC", "axonn.intra_layer.sync_gradients",
    "sync_gradients_expert_mode_depth_parallel", "sync_gradients_expert_mode_data_parallel",
    "tensor_parallel_dims",
    "axonn.inter_layer.AxoNN_Inter_Layer_Engine", "forward_backward_optimizer", "axonn.inter_layer.LossScaler",
    "axonn.inter_layer.Operation", "axonn.optim.CPUAdam",
    "axonn.checkpoint.save", "axonn.checkpoint.load", "axonn.checkpoint.get_prefix_for_checkpoint",
    "axonn.timers.Timers", "axonn.lightning.AxonnStrategy", "axonn.models.transformers.parallelize",
    "monkey_patch_opt_with_axonn", "_llama_", "_mistral_", "_mixtral_", "reverse_monkey_patch_",
]


ROWS = table_rows(os.path.join(ROOT, "docs", "tensor_parallel.md"), HEADING, "| AxoNN |")
_axonmpi_names = axonmpi_names
_resolve = resolve


def test_the_table_has_rows_and_each_names_a_counterpart_or_says_none():
    assert len(ROWS) >= 40
    for axonn, ours, _ in ROWS:
        assert axonn.startswith("`"), axonn
        assert ours == "none" or _axonmpi_names(ours), f"row {axonn!r}: name an axonmpi counterpart or say none"


@pytest.mark.parametrize("name", sorted({n for _, ours, _ in ROWS for n in _axonmpi_names(ours)}))
def test_every_axonmpi_name_in_the_table_imports(name):
    assert _resolve(name) is not None


def test_every_axonn_public_name_has_a_row():
    left = " ".join(axonn for axonn, _, _ in ROWS)
    missing = [n for n in AXONN_NAMES if n not in left]
    assert not missing, f"AxoNN names with no row in the porting table: {missing}"
