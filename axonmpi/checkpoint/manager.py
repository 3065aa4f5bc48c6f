"""CheckpointManager: numbered checkpoints in one directory, saved every N steps, the last K kept."""
from __future__ import annotations

import copy
import glob
import os
import re
import shutil
import json
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import backend as _be
from ..distributed.sharding import ShardedArray
from .format import CheckpointError, CheckpointMismatchError, flatten, unflatten
from .io import is_checkpoint, load, save
from ..distributed import phases as _phases
from .runlock import RunLock

__all__ = ["CheckpointManager", "list_run_folder"]


class CheckpointManager:
    """Save ``<directory>/step-00000100`` style checkpoints, prune old ones, find the latest.

    ``save`` and ``load_latest`` are collective over ``group``; ``latest``/``steps`` only
    look at the (shared) file system. A save replaces nothing until it is complete (see
    :func:`axonmpi.checkpoint.save`); pruning happens after the new checkpoint is in place,
    so at least one complete checkpoint survives any crash, and the checkpoint just written is
    never pruned (even when the directory holds later steps of another run: pruning then removes
    the oldest of those others and logs a warning).

    The first :meth:`save` or :meth:`clear` (or :meth:`acquire`) takes the folder's run lock
    (:class:`~axonmpi.checkpoint.runlock.RunLock`): a second job saving into the same folder is
    refused with a message naming the first. Holding it, a save also removes the ``.tmp-*``
    leftovers of saves that died (no other job can own them). ``save(..., async_save=True)``
    copies the state to host buffers (reused from save to save), returns, and writes in a
    background thread over a communicator of its own; the next save, :meth:`wait` or the end of
    the process waits for it.

    Args:
        directory: where checkpoints live (created on first save).
        keep_last: how many of the newest checkpoints to keep (None: all).
        every_steps: :meth:`should_save` is true every this many steps (None: never).
        prefix: directory-name prefix before the zero-padded step.
        group: the process group saving together (default: all ranks).

    Example:
        >>> mgr = CheckpointManager("runs/gpt/ckpt", keep_last=3, every_steps=500)
        >>> loaded = mgr.load_latest()          # None on a fresh run
        >>> for step in range(start, steps):
        ...     train_step()
        ...     if mgr.should_save(step + 1):
        ...         mgr.save(step + 1, training_state(model, opt, sampler=sampler, step=step + 1))
    """

    def __init__(self, directory: "str | os.PathLike", keep_last: Optional[int] = 3,
                 every_steps: Optional[int] = None, *, prefix: str = "step-", group=None):
        if keep_last is not None and (isinstance(keep_last, bool) or int(keep_last) < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        if every_steps is not None and (isinstance(every_steps, bool) or int(every_steps) < 1):
            raise ValueError(f"every_steps must be None or an int >= 1, got {every_steps!r}")
        if not prefix or "/" in prefix or os.sep in prefix:
            raise ValueError(f"prefix must be a non-empty file-name prefix, got {prefix!r}")
        self.directory = os.fspath(directory)
        self.keep_last = None if keep_last is None else int(keep_last)
        self.every_steps = None if every_steps is None else int(every_steps)
        self.prefix = prefix
        self.group = group
        self._pattern = re.compile(re.escape(prefix) + r"(\d+)$")
        self._lock = RunLock(self.directory)
        self._locked = False             # acquire() succeeded on every rank of the group
        self._thread: Optional[threading.Thread] = None
        self._async_result: Tuple[Optional[str], Optional[BaseException]] = (None, None)
        self._async_group = None         # a duplicate of the group for the background writes
        self._buffers: Dict[Tuple, np.ndarray] = {}   # host copies of the arrays, reused across async saves

    def path_for(self, step: int) -> str:
        """The directory of the checkpoint for ``step``."""
        if isinstance(step, bool) or int(step) < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        return os.path.join(self.directory, f"{self.prefix}{int(step):08d}")

    def steps(self) -> List[int]:
        """Steps of the complete checkpoints present, ascending."""
        if not os.path.isdir(self.directory):
            return []
        out = []
        for name in os.listdir(self.directory):
            m = self._pattern.match(name)
            if m and is_checkpoint(os.path.join(self.directory, name)):
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> Optional[int]:
        """The newest complete checkpoint's step, or None."""
        s = self.steps()
        return s[-1] if s else None

    def latest(self) -> Optional[str]:
        """The newest complete checkpoint's path, or None."""
        s = self.latest_step()
        return None if s is None else self.path_for(s)

    def should_save(self, step: int) -> bool:
        """True when ``every_steps`` divides ``step`` (and ``step > 0``)."""
        return self.every_steps is not None and int(step) > 0 and int(step) % self.every_steps == 0

    @property
    def run_id(self) -> str:
        """The id of this run recorded in the folder's lock file (shared by the managers of one process)."""
        return self._lock.run_id

    def acquire(self) -> None:
        """Take the folder's run lock on group rank 0, or check the lock still held (collective; every save).

        Raises :class:`~axonmpi.checkpoint.runlock.FolderInUseError` on every rank, naming the job
        that holds the folder, when another running job does.
        """
        from ..distributed import resolve_group
        from .agree import share
        g = resolve_group(self.group)
        err = None
        if g.rank == 0:
            try:
                if self._locked:
                    self._lock.check()       # the folder deleted meanwhile: retake the lock, or raise
                else:
                    self._lock.acquire()
            except Exception as e:
                err = e
        self._locked = False
        self._lock.run_id = share(g, self._lock.run_id, err, f"lock of {self.directory}")
        self._locked = True

    def release(self) -> None:
        """Wait for a background save, then drop the run lock (rank 0 of the group; not collective)."""
        self.wait()
        self._lock.release()
        self._locked = False

    def save(self, step: int, state: dict, *, async_save: bool = False, **kw) -> str:
        """Save ``state`` as the checkpoint for ``step`` (collective), then prune; returns its path.

        A save in flight from an earlier ``async_save=True`` is waited for first (its error, if it
        failed, is raised here). Keyword arguments go to :func:`axonmpi.checkpoint.save`.

        Args:
            step: the step number in the directory name.
            state: the nested dict to save (see :func:`axonmpi.checkpoint.save`).
            async_save: copy the arrays to host buffers, start the write in a background thread and
                return at once; the checkpoint appears at the returned path when the write ends
                (:meth:`wait` blocks until then). The arrays of ``state`` may change as soon as this
                returns. A crash during the background write leaves the previous checkpoint intact.
        """
        from ..distributed import resolve_group
        self.wait()
        self.acquire()
        g = resolve_group(self.group)
        path = self.path_for(step)
        self._move_unfinished(path, g)
        if not async_save:
            with _phases.long_phase("CheckpointManager.save", f"step {int(step)}"):
                save(path, state, self.group, **kw)
                if g.rank == 0:
                    self._prune(keep_step=int(step))
            return path
        if self._async_group is None:   # collective, on the calling thread, once
            self._async_group = g.world.split(0, parent=g, name=f"checkpoint-async:{self.directory}")
        staged = self._stage(state, g.rank)
        self._async_result = (None, None)
        self._thread = threading.Thread(target=self._write_async, args=(path, staged, int(step), kw),
                                        name=f"axonmpi-ckpt-save-{int(step)}", daemon=False)
        self._thread.start()
        return path

    def wait(self) -> Optional[str]:
        """Block until a background save is complete; return its path (None: none was pending).

        Raises the background save's error (on every rank: the save agrees on failures).
        """
        t = self._thread
        if t is None:
            return None
        t.join()
        self._thread = None
        path, err = self._async_result
        self._async_result = (None, None)
        if err is not None:
            raise err
        return path

    @property
    def pending(self) -> bool:
        """True while a background save is being written."""
        return self._thread is not None and self._thread.is_alive()

    def _stage(self, state: dict, rank: int) -> dict:
        """``state`` with every array copied into this manager's host buffers (allocated once per key)."""
        items = []
        for keys, leaf in flatten(state, rank):
            arr = leaf.local if isinstance(leaf, ShardedArray) else leaf
            if isinstance(arr, np.ndarray) or _be.is_cupy_array(arr):
                buf = self._buffers.get(keys)
                if buf is None or buf.shape != arr.shape or buf.dtype != arr.dtype:
                    buf = self._buffers[keys] = (np.empty(arr.shape, arr.dtype) if isinstance(arr, np.ndarray)
                                                 else _be.empty_pinned(arr.size, arr.dtype).reshape(arr.shape))
                if isinstance(arr, np.ndarray):
                    np.copyto(buf, arr)
                else:
                    arr.get(out=buf)
                leaf = ShardedArray(buf, leaf.global_shape, leaf.offsets) if isinstance(leaf, ShardedArray) else buf
            else:
                leaf = copy.deepcopy(leaf)   # lists and dicts the caller may change while the write runs
            items.append((keys, leaf))
        return unflatten(items)

    def _write_async(self, path: str, staged: dict, step: int, kw: dict) -> None:
        try:
            save(path, staged, self._async_group, **kw)
            if self._async_group.rank == 0:
                self._prune(keep_step=step)
            self._async_result = (path, None)
        except BaseException as e:   # kept for wait(), which raises it on the training thread
            from ..log import get_logger
            get_logger(__name__).error("background save to %s failed: %s: %s", path, type(e).__name__, e)
            self._async_result = (None, e)

    def clear(self) -> List[int]:
        """Delete every checkpoint of this manager's directory (rank 0 of ``group``; collective).

        For a fresh run that was told to overwrite an old one. Returns the steps removed.
        """
        from ..distributed import broadcast_object, resolve_group
        self.wait()
        self.acquire()
        g = resolve_group(self.group)
        removed = []
        if g.rank == 0:
            removed = self.steps()
            for s in removed:
                shutil.rmtree(self.path_for(s), ignore_errors=True)
        return broadcast_object(removed, group=g)  # the others wait here until rank 0 is done

    def damaged(self) -> List[str]:
        """Paths of checkpoints set aside as damaged (``<prefix>N.damaged[-K]``), oldest step first."""
        if not os.path.isdir(self.directory):
            return []
        pat = re.compile(re.escape(self.prefix) + r"(\d+)\.damaged(-\d+)?$")
        found = [(int(m.group(1)), n) for n in os.listdir(self.directory) for m in [pat.match(n)] if m]
        return [os.path.join(self.directory, n) for _, n in sorted(found)]

    def load_latest(self, state: Optional[dict] = None, *, fallback: bool = True, memory=None, **kw) -> Optional[dict]:
        """Load the newest intact checkpoint (collective); None only when the folder holds no checkpoint.

        With ``memory`` (a :class:`~axonmpi.checkpoint.memory.MemoryCheckpointer`), the newest step complete in
        node memory is loaded instead when it is at least as new (resharded like a checkpoint; the log says
        which source and step: :func:`axonmpi.checkpoint.memory.resume`).

        With ``fallback`` (default), a checkpoint that fails to load is verified (every block
        against its checksum, as ``axonmpi ckpt verify`` does). Only one that fails verification is
        damaged: it is renamed ``<path>.damaged`` (kept for inspection), a warning names it and
        its problems, and the next older one is tried. A checkpoint that verifies but does not fit
        ``state`` (another dtype, shape or set of entries) is never renamed: its
        :class:`~axonmpi.checkpoint.format.CheckpointMismatchError` is raised, naming the first
        entry and what to do. When every checkpoint is damaged (or only ``.damaged`` ones are
        left) a :class:`~axonmpi.checkpoint.CheckpointError` names them instead of returning None,
        so a run never restarts from step 0 silently. Keyword arguments go to
        :func:`axonmpi.checkpoint.load` (``cast=True`` converts dtypes).
        """
        if memory is not None:
            from .memory import resume
            return resume(self, memory, state, fallback=fallback, **kw)[0]
        out = self.load_newest_intact(lambda path: load(path, state, self.group, **kw), fallback=fallback)
        return None if out is None else out[1]

    def load_newest_intact(self, load_fn, *, fallback: bool = True):
        """``(step, load_fn(path))`` for the newest checkpoint ``load_fn`` reads; None when there is none.

        Collective over the group. When ``load_fn`` raises a :class:`CheckpointError`, the ranks
        verify the checkpoint together (every file and block, each rank a share of the files). One that fails verification is moved aside to
        ``<path>.damaged`` with a warning naming it and its problems (never deleted), and the next
        older one is tried; one that verifies is not damage: the error is raised as it is (a
        template that does not fit, an option the caller refused). With ``fallback=False`` the first
        error is raised. Raises :class:`CheckpointError` naming the folder when no intact checkpoint
        is left but damaged ones are there.
        """
        from ..distributed import all_gather_object, broadcast_object, resolve_group
        from ..log import get_logger
        g = resolve_group(self.group)
        log = get_logger(__name__, rank0_only=True)
        steps, damaged = broadcast_object((self.steps(), self.damaged()) if g.rank == 0 else None, group=g)
        set_aside, kept = [], list(damaged)
        for i, step in enumerate(reversed(steps)):
            path = self.path_for(step)
            try:
                return step, load_fn(path)
            except CheckpointMismatchError:   # intact, does not fit: never damage
                raise
            except CheckpointError as e:   # raised on every rank (load agrees on failures)
                if not fallback:
                    raise
                problems = [x for part in all_gather_object(_verify_problems(path, g.rank, g.size), group=g)
                            for x in part]   # each rank checks its share of the files
                if not problems:
                    raise                  # the checkpoint is intact: the error is about the caller's side
                older = steps[-2 - i] if i + 1 < len(steps) else None
                aside = self._set_aside(path, g)
                kept.append(aside)
                set_aside.append(f"{path} ({problems[0]}{f' and {len(problems) - 1} more' if len(problems) > 1 else ''})")
                log.warning("checkpoint %s failed verification: %s; moved it to %s and %s", path,
                            "; ".join(problems[:3]) + (f"; ... {len(problems) - 3} more" if len(problems) > 3 else ""),
                            aside, f"falling back to step {older}" if older is not None else
                            "no older checkpoint is left")
        if kept:
            raise CheckpointError(
                f"no intact checkpoint in {self.directory}: "
                + (f"every checkpoint failed verification: {'; '.join(set_aside)}. " if set_aside else "")
                + f"The damaged ones are kept as {kept} (`axonmpi ckpt verify {self.directory}` lists "
                "their problems). Nothing was loaded; to start fresh anyway, move them out of the folder")
        return None

    def unfinished(self) -> List[str]:
        """Paths of folders set aside by :meth:`save` as unfinished saves (``<prefix>N.unfinished[-K]``)."""
        if not os.path.isdir(self.directory):
            return []
        pat = re.compile(re.escape(self.prefix) + r"(\d+)\.unfinished(-\d+)?$")
        found = [(int(m.group(1)), n) for n in os.listdir(self.directory) for m in [pat.match(n)] if m]
        return [os.path.join(self.directory, n) for _, n in sorted(found)]

    def _move_unfinished(self, path: str, g) -> None:
        """Before saving ``path``: a folder there without an index (an interrupted save, or one whose index
        was lost) is moved to ``<path>.unfinished[-N]`` (kept for inspection, never read as a checkpoint)
        and named in a warning, so that the same step saves again (collective; group rank 0 moves it).

        ``load_latest`` skips such a folder (it has no index), so a resumed run comes back to its step;
        without this the save of that step refused to replace it and every rerun lost the same steps.
        Only a folder that holds nothing but a save's files (``shard-*.h5``, ``data.h5``) is moved: one with
        other files is not a checkpoint and the save refuses to replace it, as before."""
        from ..distributed import broadcast_object
        from ..log import get_logger
        moved, err = None, None
        if g.rank == 0 and _interrupted_save(path):
            aside, n = f"{path}.unfinished", 1
            while os.path.lexists(aside):
                aside, n = f"{path}.unfinished-{n}", n + 1
            try:
                os.rename(path, aside)
                moved = aside
            except OSError as e:
                err = f"{type(e).__name__}: {e}"
        moved, err = broadcast_object((moved, err), group=g) if g.size > 1 else (moved, err)
        if err is not None:
            raise CheckpointError(f"{path} has no index.h5 (an interrupted save) and could not be moved aside to save "
                                  f"there again: {err}; move it out of {self.directory} by hand")
        if moved is not None and g.rank == 0:
            get_logger(__name__).warning(
                "%s has no index.h5 (a save that was interrupted, or whose index was lost): moved it to %s "
                "(kept for inspection; `axonmpi ckpt inspect %s` lists it) and saving step %s again",
                path, moved, self.directory, os.path.basename(path)[len(self.prefix):].lstrip("0") or "0")

    def _set_aside(self, path: str, g) -> str:
        """Rename a damaged checkpoint to ``<path>.damaged[-N]`` (group rank 0; collective)."""
        from ..distributed import broadcast_object
        aside = None
        if g.rank == 0:
            aside, n = f"{path}.damaged", 1
            while os.path.lexists(aside):
                aside, n = f"{path}.damaged-{n}", n + 1
            try:
                os.rename(path, aside)
            except OSError as e:
                aside = f"(not moved: {e})"
        return broadcast_object(aside, group=g)

    def _prune(self, keep_step: int) -> None:
        """Remove checkpoints beyond ``keep_last`` and leftovers of crashed saves (rank 0)."""
        from ..log import get_logger
        log = get_logger(__name__)
        doomed = []
        others = [s for s in self.steps() if s != keep_step]
        later = [s for s in others if s > keep_step]
        if later:
            log.warning("%s also holds checkpoints of later steps %s than the one just written (%d); "
                        "latest() returns the highest step", self.directory, later, keep_step)
        if self.keep_last is not None:
            # the checkpoint just written always survives, whatever its step; the others go
            # oldest-step first until keep_last remain
            n_drop = max(0, len(others) + 1 - self.keep_last)
            doomed = [self.path_for(s) for s in others[:n_drop]]
        # leftovers of crashed saves. .tmp-*: this run holds the folder's lock and its own save is
        # committed, so every .tmp-* is from a save that died. .old-*: only where the checkpoint it
        # belongs to is complete or doomed (after a crash between the two renames of a non-atomic
        # replace, <p>.old-* is the only copy)
        for pat in (".tmp-*", ".old-*"):
            for left in glob.glob(os.path.join(glob.escape(self.directory), glob.escape(self.prefix) + "*" + pat)):
                base = left[:left.rindex(pat[:-1])]
                if (pat == ".tmp-*" and self._lock.held) or is_checkpoint(base) or base in doomed:
                    if pat == ".tmp-*":
                        log.info("removing %s, left by a save that did not finish", left)
                    doomed.append(left)
        for p in doomed:
            try:
                shutil.rmtree(p)
            except FileNotFoundError:
                pass
            except OSError as e:  # never fail a save because an old checkpoint could not go
                log.warning("could not remove old checkpoint %s: %s", p, e)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, keep_last={self.keep_last}, "
                f"every_steps={self.every_steps}, latest_step={self.latest_step()})")


_SAVE_FILES = re.compile(r"shard-\d{5}\.h5|data\.h5|index\.h5")


def _interrupted_save(path: str) -> bool:
    """True for a folder without an index that holds only files a save writes (an interrupted save)."""
    if not os.path.isdir(path) or os.path.islink(path) or is_checkpoint(path):
        return False
    names = os.listdir(path)
    return bool(names) and all(_SAVE_FILES.fullmatch(n) for n in names)


def _verify_problems(path: str, part: int = 0, parts: int = 1) -> List[str]:
    """The problems ``axonmpi ckpt verify`` finds in the checkpoint at ``path`` ([] when it is intact).

    Split over ``parts`` callers: this one checks the index and file sizes (part 0) and the blocks
    of every ``parts``-th data file from ``part``.
    """
    from .read import CheckpointReader
    try:
        with CheckpointReader(path) as r:
            problems = r.file_problems() if part == 0 else []
            bad = {p.file for p in r.file_problems() if not p.entry}
            mine = [f for i, f in enumerate(r.files()) if i % parts == part and f not in bad]
            problems += r.verify_all(mine)
    except Exception as e:   # the index itself is missing, unreadable or fails its checksum
        return [f"{type(e).__name__}: {e}"] if part == 0 else []
    return [(f"entry {p.entry!r} in {p.file}: " if p.entry else f"{p.file}: ") + p.message for p in problems]


def run_folder_rows(path: "str | os.PathLike", prefix: str = "step-") -> Optional[List[dict]]:
    """The ``<prefix>N*`` directories of a run folder with their state; None when ``path`` is not a run folder.

    Each row: ``step``, ``path``, ``bytes``, ``modified``, ``has_index``, ``complete`` (a checkpoint
    ``load_latest`` would consider: an index, no suffix, every data file present with its size)
    and ``status`` (one line: what the directory is).
    """
    path = os.fspath(path)
    if not os.path.isdir(path) or is_checkpoint(path):
        return None
    pattern = re.compile(re.escape(prefix) + r"(\d+)(.*)$")
    rows = []
    for name in sorted(os.listdir(path)):
        m = pattern.match(name)
        full = os.path.join(path, name)
        if not m or not os.path.isdir(full):
            continue
        size = sum(os.path.getsize(os.path.join(full, f)) for f in os.listdir(full)
                   if os.path.isfile(os.path.join(full, f)))
        suffix, has_index = m.group(2), is_checkpoint(full)
        problems = _file_problems(full) if has_index else []
        if suffix.startswith(".unfinished"):
            status = "set aside by a later save: an interrupted save (no index.h5), kept for inspection"
        elif suffix.startswith(".tmp-") or not has_index:
            status = "incomplete: an unfinished or crashed save (no index.h5)" if not has_index else \
                "incomplete: an unfinished or crashed save"
        elif suffix.startswith(".damaged"):
            status = ("set aside by load_latest after failing verification" +
                      (f": {problems[0]}" if problems else "; `axonmpi ckpt verify` checks every block"))
        elif suffix.startswith(".old-"):
            status = "the previous checkpoint, kept by a save that crashed between its two renames"
        elif suffix:
            status = f"not a checkpoint name ({prefix}N{suffix})"
        elif problems:
            status = f"DAMAGED: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
        else:
            status = "complete"
        rows.append({"step": int(m.group(1)), "path": full, "bytes": size, "has_index": has_index,
                     "complete": has_index and not suffix and not problems, "status": status,
                     "modified": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(full)))})
    return rows or None


def _file_problems(path: str) -> List[str]:
    """Missing, unreadable or short files of a checkpoint (no block read), as ``inspect`` reports them."""
    from .read import CheckpointReader
    try:
        with CheckpointReader(path) as r:
            return [(f"{p.file}: " if p.file else "") + p.message for p in r.file_problems()]
    except Exception as e:
        return [f"{type(e).__name__}: {e}"]


def list_run_folder(path: "str | os.PathLike", as_json: bool = False, out=None, *, prefix: str = "step-") -> bool:
    """Print the ``step-*`` checkpoints of a run folder (step, size, time, state); False when ``path`` is not one.

    What ``axonmpi ckpt inspect RUN_DIR`` shows for a folder a :class:`CheckpointManager` writes
    into: unfinished saves (no index) are listed as such, checkpoints set aside as damaged as
    such, and each checkpoint's files are checked as ``inspect PATH`` does (no block is read:
    ``axonmpi ckpt verify RUN_DIR`` reads them all).

    Example:
        >>> list_run_folder("checkpoints/gpt")
        True
    """
    rows = run_folder_rows(path, prefix)
    if rows is None:
        return False
    path = os.fspath(path)
    out = out or sys.stdout
    if as_json:
        out.write(json.dumps({"run_folder": path, "checkpoints": rows}, indent=1) + "\n")
        return True
    out.write(f"run folder  {path}: {sum(r['complete'] for r in rows)} complete checkpoint(s)\n\n")
    out.write(f"{'step':>10}  {'MiB':>9}  {'modified':<19}  path\n")
    for r in rows:
        note = "" if r["status"] == "complete" else f"   ({r['status']})"
        out.write(f"{r['step']:>10}  {r['bytes'] / 2**20:>9.1f}  {r['modified']:<19}  {r['path']}{note}\n")
    out.write(f"\ninspect one with: axonmpi ckpt inspect {rows[-1]['path']}; check every block with: "
              f"axonmpi ckpt verify {path}\n")
    return True
