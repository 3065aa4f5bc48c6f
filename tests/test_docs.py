"""Every ```python block in README.md and docs/*.md runs: one process, or N ranks when it starts with `# mpiexec -n N`;
every ```bash block runs too, all of one file's in order in one folder (a walk-through: its commands as printed,
from a folder that looks like a clone after ``make install``: the repository's files and ``.venv``).

Every fenced block either runs here or is marked not runnable with its reason: the line directly above it
reads ``<!-- norun: why -->`` (GPU- or cluster-only snippets, long runs, installs, output, diagrams, signatures).
``test_every_block_runs_or_says_why`` holds every block, in any language, to that; a bare
``<!-- norun -->`` (no reason) fails it. Files are discovered when the tests are
collected, so new docs are covered without editing this file. Each block runs in its own
temporary directory with the repository on ``PYTHONPATH``.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from typing import List, NamedTuple

import pytest

from axonmpi.testing import mpiexec_env, run_mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NORUN = re.compile(r"^<!-- norun: (\S.*\S) -->$")
_MPIEXEC = re.compile(r"#\s*mpiexec\s+-n\s+(\d+)\b")
_TIMEOUT = 120
_SHELL = ("bash", "sh", "shell")
_SHELL_TIMEOUT = 300
_BATCH_TIMEOUT = 600


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
        if lang in ("python", "py") and not NORUN.match(prev):
            first = next((ln for ln in body if ln.strip()), "")
            m = _MPIEXEC.match(first.strip())
            blocks.append(Block(path, start + 1, "\n".join(body) + "\n", int(m.group(1)) if m else 0))
        i = j + 1
    return blocks


def extract_shell_blocks(text: str, path: str = "<doc>") -> List[Block]:
    """The runnable ```bash blocks of a Markdown text (norun-marked ones left out), in order.

    Example:
        >>> [b.code for b in extract_shell_blocks("```bash\\nls\\n```\\n<!-- norun: x -->\\n```bash\\nrm -r /\\n```\\n")]
        ['ls\\n']
    """
    lines = text.splitlines()
    return [Block(path, i + 1, "\n".join(lines[i + 1:j]) + "\n", 0) for i, j, lang, prev in _fences(lines)
            if lang.lower() in _SHELL and not prev.startswith("<!-- norun")]


def _fences(lines: List[str]):
    """Each fenced block of ``lines``: (opening line index, closing line index, language, the line before it)."""
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+|~~~+)\s*(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence.group(2)):
            j += 1
        yield i, j, fence.group(3), next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        i = j + 1


def _doc_files() -> List[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _all_blocks() -> List[Block]:
    out = []
    for f in _doc_files():
        with open(f, encoding="utf-8") as fh:
            out += extract_blocks(fh.read(), os.path.relpath(f, ROOT))
    return out


BLOCKS = _all_blocks()


def _shell_walks():
    out = {}
    for f in _doc_files():
        with open(f, encoding="utf-8") as fh:
            got = extract_shell_blocks(fh.read(), os.path.relpath(f, ROOT))
        if got:
            out[os.path.relpath(f, ROOT)] = got
    return out


WALKS = _shell_walks()


def test_extractor_follows_the_convention():
    text = ("x\n```python\nprint('a')\n```\n\n<!-- norun: a GPU -->\n```python\nraise SystemExit(1)\n```\n"
            "```bash\nexit 1\n```\n- item:\n\n  ```python\n  # mpiexec -n 3\n  print('b')\n  ```\n")
    got = extract_blocks(text)
    assert [(b.line, b.ranks, b.code) for b in got] == [(2, 0, "print('a')\n"), (15, 3, "# mpiexec -n 3\nprint('b')\n")]


def test_blocks_found():
    assert any(b.path == "README.md" for b in BLOCKS), "README.md lost its runnable example"


def _unmarked(text: str) -> List[str]:
    """The fenced blocks of a Markdown text that neither run here (python) nor carry ``<!-- norun: why -->``."""
    bad = []
    for i, _, lang, prev in _fences(text.splitlines()):
        runs = lang.lower() in ("python", "py") + _SHELL
        if not NORUN.match(prev) and (not runs or prev.startswith("<!-- norun")):
            bad.append(f"line {i + 1} ({lang or 'no language'})")
    return bad


def test_every_block_runs_or_says_why():
    assert _unmarked("```text\nls\n```\n<!-- norun -->\n```python\nx\n```\n```bash\nls\n```\n") == \
        ["line 1 (text)", "line 5 (python)"]
    bad = {}
    for f in _doc_files():
        with open(f, encoding="utf-8") as fh:
            got = _unmarked(fh.read())
        if got:
            bad[os.path.relpath(f, ROOT)] = got
    assert not bad, ("blocks that neither run in this test nor say why not (put '<!-- norun: the reason -->' on the "
                     f"line above each): {bad}")


def test_grid_md_shows_inits_signature():
    import inspect
    import axonmpi
    text = open(os.path.join(ROOT, "docs", "grid.md"), encoding="utf-8").read()
    shown = re.search(r"```\n(axonmpi\.init\(.*?\))\n```", text, re.S).group(1)
    params = []
    for p in inspect.signature(axonmpi.init).parameters.values():
        if p.kind is p.KEYWORD_ONLY and "*" not in params:
            params.append("*")
        params.append(f"{p.name}={p.default!r}".replace("'", '"'))
    assert " ".join(shown.split()) == "axonmpi.init(" + ", ".join(params) + ")"


def _script(block: Block, folder) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / (re.sub(r"\W", "_", block.path) + f"_L{block.line}.py")
    script.write_text(block.code, encoding="utf-8")
    return str(script)


def _run_alone(block: Block, folder):
    script = _script(block, folder)
    if block.ranks:
        return run_mpiexec([script], n=block.ranks, timeout=_TIMEOUT, cwd=str(folder))
    return subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=_TIMEOUT,
                          env=mpiexec_env(), cwd=str(folder))


@pytest.fixture(scope="session")
def batched_blocks(request, tmp_path_factory):
    """The blocks this session runs, grouped by rank count and run in one job per group (tests/doc_batch.py):
    ``{block id: True}`` for each block that passed there on every rank. Blocks not reported ok run alone."""
    chosen = [it.callspec.params["block"] for it in request.session.items
              if it.originalname == "test_doc_block_runs" and hasattr(it, "callspec")]
    root = tmp_path_factory.mktemp("doc_batches")
    passed = {}
    for ranks in sorted({b.ranks for b in chosen}):
        plan = [{"id": f"{b.path}:{b.line}", "script": _script(b, root / f"{ranks}" / f"b{i}"),
                 "cwd": str(root / f"{ranks}" / f"b{i}")} for i, b in enumerate(chosen) if b.ranks == ranks]
        plan_path, results = root / f"plan{ranks}.json", root / f"results{ranks}.jsonl"
        plan_path.write_text(json.dumps(plan), encoding="utf-8")
        runner = [os.path.join(ROOT, "tests", "doc_batch.py"), str(plan_path), str(results)]
        try:
            if ranks:
                run_mpiexec(runner, n=ranks, timeout=_BATCH_TIMEOUT, cwd=str(root))
            else:
                subprocess.run([sys.executable, *runner], capture_output=True, text=True, timeout=_BATCH_TIMEOUT,
                               env=mpiexec_env(), cwd=str(root))
        except subprocess.TimeoutExpired:
            pass                                    # the blocks it did not report run alone
        if results.exists():
            for line in results.read_text(encoding="utf-8").splitlines():
                row = json.loads(line)
                passed[row["id"]] = passed.get(row["id"], True) and row["ok"]
    return passed


@pytest.mark.serial
@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.path}:{b.line}" for b in BLOCKS])
def test_doc_block_runs(block, tmp_path, batched_blocks):
    """Each block passes in its rank count's batch job, or else run alone (which decides: a block may depend on
    a fresh process, e.g. a first ``init`` with its own grid)."""
    if batched_blocks.get(f"{block.path}:{block.line}"):
        return
    r = _run_alone(block, tmp_path)
    assert r.returncode == 0, (f"{block.path}:{block.line} failed ({block.ranks or 1} process(es)), "
                               f"exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")


@pytest.mark.serial
@pytest.mark.parametrize("path", sorted(WALKS))
def test_doc_shell_blocks_run_as_printed(path, tmp_path):
    """A file's unmarked ```bash blocks, in order, with ``bash -eo pipefail``, in one folder holding the repository's
    files and ``.venv`` (this Python's environment): the commands a reader pastes after ``make install``."""
    if any("transformers" in b.code for b in WALKS[path]):
        pytest.importorskip("transformers")
    for name in os.listdir(ROOT):
        if name not in (".git", ".venv") and not name.startswith(".test"):
            os.symlink(os.path.join(ROOT, name), tmp_path / name)
    os.symlink(sys.prefix, tmp_path / ".venv")
    for b in WALKS[path]:
        r = subprocess.run(["bash", "-eo", "pipefail", "-c", b.code], capture_output=True, text=True,
                           timeout=_SHELL_TIMEOUT, env=mpiexec_env(), cwd=str(tmp_path))
        assert r.returncode == 0, (f"{b.path}:{b.line} failed, exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}"
                                   f"\n--- stderr\n{r.stderr[-3000:]}")
