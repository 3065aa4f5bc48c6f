"""docs/porting.md's "Torch's paths" table: every served name of every row imports from the axonmpi path the import
rule gives (`torch` becomes `axonmpi`), and, where torch is installed, the torch path holds the name too (so the
row is torch's). Names marked not served are checked absent here."""
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADING = "## Torch's paths"


def _rows():
    text = open(os.path.join(ROOT, "docs", "porting.md"), encoding="utf-8").read()
    body = text[text.index(HEADING):]
    body = body[:body.index("\n## ", 3)] if "\n## " in body[3:] else body
    rows = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`torch") or cells[0] == "torch path":
            continue
        path = cells[0].strip("`")
        names = re.findall(r"`([A-Za-z_][\w.]*)`", cells[1])
        rows.append((path, names))
    return rows


ROWS = _rows()


def _ours(path):
    return "axonmpi" + path[len("torch"):]


def test_the_table_has_the_tutorials_paths():
    paths = {p for p, _ in ROWS}
    for p in ("torch.utils.data", "torch.utils.data.distributed", "torch.nn.parallel", "torch.distributed.fsdp",
              "torch.distributed.fsdp.fully_sharded_data_parallel", "torch.distributed.fsdp.wrap",
              "torch.multiprocessing", "torch.distributed.tensor.parallel", "torch.distributed._tensor.device_mesh",
              "torch.optim.lr_scheduler"):
        assert p in paths, f"docs/porting.md's table has no row for {p}"


@pytest.mark.parametrize("path,names", [r for r in ROWS if r[1]], ids=[r[0] for r in ROWS if r[1]])
def test_every_served_name_imports_by_the_rule(path, names):
    mod = importlib.import_module(_ours(path))
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{_ours(path)} lacks {missing} (docs/porting.md says they are served)"


@pytest.mark.parametrize("path,names", [r for r in ROWS if r[1]], ids=[r[0] for r in ROWS if r[1]])
def test_every_row_is_torchs(path, names):
    pytest.importorskip("torch")
    mod = importlib.import_module(path)
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{path} has no {missing}: the row names what torch does not"
