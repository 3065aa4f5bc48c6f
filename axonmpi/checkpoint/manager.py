"""CheckpointManager: numbered checkpoints in one directory, saved every N steps, the last K kept."""
from __future__ import annotations

import glob
import os
import re
import shutil
import json
import sys
import time
from typing import List, Optional

from .io import is_checkpoint, load, save

__all__ = ["CheckpointManager", "list_run_folder"]


class CheckpointManager:
    """Save ``<directory>/step-00000100`` style checkpoints, prune old ones, find the latest.

    ``save`` and ``load_latest`` are collective over ``group``; ``latest``/``steps`` only
    look at the (shared) file system. A save replaces nothing until it is complete (see
    :func:`axonmpi.checkpoint.save`); pruning happens after the new checkpoint is in place,
    so at least one complete checkpoint survives any crash, and the checkpoint just written is
    never pruned (even when the directory holds later steps of another run: pruning then removes
    the oldest of those others and logs a warning).

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

    def save(self, step: int, state: dict, **kw) -> str:
        """Save ``state`` as the checkpoint for ``step`` (collective), then prune; returns its path.

        Keyword arguments go to :func:`axonmpi.checkpoint.save`.
        """
        from ..distributed import resolve_group
        path = save(self.path_for(step), state, self.group, **kw)
        if resolve_group(self.group).rank == 0:
            self._prune(keep_step=int(step))
        return path

    def clear(self) -> List[int]:
        """Delete every checkpoint of this manager's directory (rank 0 of ``group``; collective).

        For a fresh run that was told to overwrite an old one. Returns the steps removed.
        """
        from ..distributed import broadcast_object, resolve_group
        g = resolve_group(self.group)
        removed = []
        if g.rank == 0:
            removed = self.steps()
            for s in removed:
                shutil.rmtree(self.path_for(s), ignore_errors=True)
        return broadcast_object(removed, group=g)  # the others wait here until rank 0 is done

    def load_latest(self, state: Optional[dict] = None, **kw) -> Optional[dict]:
        """Load the newest checkpoint (collective); None when there is none.

        Keyword arguments go to :func:`axonmpi.checkpoint.load`.
        """
        from ..distributed import broadcast_object, resolve_group
        g = resolve_group(self.group)
        path = self.latest() if g.rank == 0 else None
        path = broadcast_object(path, group=g)
        if path is None:
            return None
        return load(path, state, g, **kw)

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
        # leftovers of crashed saves: only where the checkpoint they belong to is complete or doomed
        # (after a crash between the two renames of a non-atomic replace, <p>.old-* is the only copy)
        for pat in (".tmp-*", ".old-*"):
            for left in glob.glob(os.path.join(glob.escape(self.directory), glob.escape(self.prefix) + "*" + pat)):
                base = left[:left.rindex(pat[:-1])]
                if is_checkpoint(base) or base in doomed:
                    doomed.append(left)
        for p in doomed:
            try:
                shutil.rmtree(p)
            except FileNotFoundError:
                pass
            except OSError as e:  # never fail a save because an old checkpoint could not go
                log.warning("could not remove old checkpoint %s: %s", p, e)

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, keep_last={self.keep_last}, "
                f"every_steps={self.every_steps}, latest_step={self.latest_step()})")


def list_run_folder(path: "str | os.PathLike", as_json: bool = False, out=None, *, prefix: str = "step-") -> bool:
    """Print the ``step-*`` checkpoints of a run folder (step, size, time); False when ``path`` is not one.

    What ``axonmpi ckpt inspect RUN_DIR`` shows for a folder a :class:`CheckpointManager` writes
    into; unfinished saves (no index) are listed as such.

    Example:
        >>> list_run_folder("checkpoints/gpt")
        True
    """
    path = os.fspath(path)
    if not os.path.isdir(path) or is_checkpoint(path):
        return False
    pattern = re.compile(re.escape(prefix) + r"(\d+)(.*)$")
    rows = []
    for name in sorted(os.listdir(path)):
        m = pattern.match(name)
        full = os.path.join(path, name)
        if not m or not os.path.isdir(full):
            continue
        size = sum(os.path.getsize(os.path.join(full, f)) for f in os.listdir(full)
                   if os.path.isfile(os.path.join(full, f)))
        complete = is_checkpoint(full) and not m.group(2)
        rows.append({"step": int(m.group(1)), "path": full, "complete": complete, "bytes": size,
                     "modified": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(full)))})
    if not rows:
        return False
    out = out or sys.stdout
    if as_json:
        out.write(json.dumps({"run_folder": path, "checkpoints": rows}, indent=1) + "\n")
        return True
    out.write(f"run folder  {path}: {sum(r['complete'] for r in rows)} complete checkpoint(s)\n\n")
    out.write(f"{'step':>10}  {'MiB':>9}  {'modified':<19}  path\n")
    for r in rows:
        note = "" if r["complete"] else "   (incomplete: an unfinished or crashed save)"
        out.write(f"{r['step']:>10}  {r['bytes'] / 2**20:>9.1f}  {r['modified']:<19}  {r['path']}{note}\n")
    out.write(f"\ninspect one with: axonmpi ckpt inspect {rows[-1]['path']}\n")
    return True
