"""The torch.distributed porting table of docs/porting.md: every axonmpi name in it imports, and every
torch.distributed name a training script calls (the list below, from torch 2.13; checked against torch where it
is installed) has a row. The model is tests/test_docs_porting_table.py (AxoNN's table)."""
import os
import re

import pytest

from axonmpi.testing.doc_tables import axonmpi_names, resolve, table_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADING = "### Every `torch.distributed` name"

TORCH_NAMES = [
    "init_process_group", "destroy_process_group", "is_initialized", "is_available", "is_mpi_available",
    "is_gloo_available", "is_nccl_available", "is_torchelastic_launched", "get_rank", "get_world_size", "get_backend",
    "new_group", "new_subgroups", "new_subgroups_by_enumeration", "get_process_group_ranks", "get_global_rank",
    "get_group_rank", "group", "GroupMember", "Backend", "ReduceOp", "Work", "barrier", "monitored_barrier",
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "P2POp", "batch_isend_irecv", "broadcast_object_list", "all_gather_object", "gather_object",
    "scatter_object_list", "TCPStore", "FileStore", "HashStore", "PrefixStore", "Store", "device_mesh",
]


ROWS = table_rows(os.path.join(ROOT, "docs", "porting.md"), HEADING, "| torch.distributed |")
_axonmpi_names = axonmpi_names
_resolve = resolve


def test_the_table_has_rows_and_each_names_a_counterpart_or_says_none():
    assert len(ROWS) >= 30
    for theirs, ours, _ in ROWS:
        assert theirs.startswith("`"), theirs
        assert ours == "none" or _axonmpi_names(ours), f"row {theirs!r}: name an axonmpi counterpart or say none"


def _all_names_in_the_doc():
    text = open(os.path.join(ROOT, "docs", "porting.md"), encoding="utf-8").read()
    body = text[text.index(HEADING):]
    return sorted({n for line in body.splitlines() if line.startswith("|") for n in _axonmpi_names(line)})


@pytest.mark.parametrize("name", _all_names_in_the_doc())
def test_every_axonmpi_name_in_the_tables_imports(name):
    _resolve(name)                 # raises where a name is missing (group.WORLD is None, as torch's)


def test_every_torch_distributed_name_has_a_row():
    left = " ".join(theirs for theirs, _, _ in ROWS)
    missing = [n for n in TORCH_NAMES if not re.search(rf"(?<![\w.]){re.escape(n)}\b", left)]
    assert not missing, f"torch.distributed names with no row in docs/porting.md: {missing}"


def test_the_list_is_torchs():
    dist = pytest.importorskip("torch.distributed")
    absent = [n for n in TORCH_NAMES if not hasattr(dist, n)]
    assert not absent, f"not torch.distributed names (the list is wrong): {absent}"
