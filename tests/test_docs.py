"""Every ```python block in README.md and docs/*.md runs: one process, or N ranks when it starts with `# mpiexec -n N`.

A block directly preceded by the line ``<!-- norun -->`` is skipped (GPU- or cluster-only
snippets); other languages (bash, text) are never run. Files are discovered when the tests are
collected, so new docs are covered without editing this file. Each block runs in its own
temporary directory with the repository on ``PYTHONPATH``.
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from typing import List, NamedTuple

import pytest

from axonmpi.testing import mpiexec_env, run_mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NORUN = "<!-- norun -->"
_MPIEXEC = re.compile(r"#\s*mpiexec\s+-n\s+(\d+)\b")
_TIMEOUT = 120


class Block(NamedTuple):
    """One runnable code block: where it is, its source and how many ranks run it (0: one plain process)."""
    path: str
    line: int
    code: str
    ranks: int


def extract_blocks(text: str, path: str = "<doc>") -> List[Block]:
    """The runnable ```python blocks of a Markdown text (norun-marked ones left out).

    Example:
        >>> extract_blocks("```python\\n# mpiexec -n 2\\nprint(1)\\n```\\n")[0].ranks
        2
    """
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+|~~~+)\s*(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, lang = fence.group(1), fence.group(2), fence.group(3).lower()
        start, j = i, i + 1
        while j < len(lines) and not lines[j].strip().startswith(ticks):
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[start + 1:j]]
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        if lang in ("python", "py") and prev != NORUN:
            first = next((ln for ln in body if ln.strip()), "")
            m = _MPIEXEC.match(first.strip())
            blocks.append(Block(path, start + 1, "\n".join(body) + "\n", int(m.group(1)) if m else 0))
        i = j + 1
    return blocks


def _doc_files() -> List[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _all_blocks() -> List[Block]:
    out = []
    for f in _doc_files():
        with open(f, encoding="utf-8") as fh:
            out += extract_blocks(fh.read(), os.path.relpath(f, ROOT))
    return out


BLOCKS = _all_blocks()


def test_extractor_follows_the_convention():
    text = ("x\n```python\nprint('a')\n```\n\n<!-- norun -->\n```python\nraise SystemExit(1)\n```\n"
            "```bash\nexit 1\n```\n- item:\n\n  ```python\n  # mpiexec -n 3\n  print('b')\n  ```\n")
    got = extract_blocks(text)
    assert [(b.line, b.ranks, b.code) for b in got] == [(2, 0, "print('a')\n"), (15, 3, "# mpiexec -n 3\nprint('b')\n")]


def test_blocks_found():
    assert any(b.path == "README.md" for b in BLOCKS), "README.md lost its runnable example"


@pytest.mark.serial
@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.path}:{b.line}" for b in BLOCKS])
def test_doc_block_runs(block, tmp_path):
    script = tmp_path / (re.sub(r"\W", "_", block.path) + f"_L{block.line}.py")
    script.write_text(block.code, encoding="utf-8")
    if block.ranks:
        r = run_mpiexec([str(script)], n=block.ranks, timeout=_TIMEOUT, cwd=str(tmp_path))
    else:
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=_TIMEOUT,
                           env=mpiexec_env(), cwd=str(tmp_path))
    assert r.returncode == 0, (f"{block.path}:{block.line} failed ({block.ranks or 1} process(es)), "
                               f"exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
