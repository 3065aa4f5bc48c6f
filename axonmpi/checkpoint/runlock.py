"""RunLock: one job at a time per checkpoint folder (an ``flock`` on ``<folder>/.axonmpi-run.lock``).

Two jobs saving into one folder delete each other's in-flight saves (each prunes the other's
``.tmp-*``) and interleave their steps. The lock is held by group rank 0 of the saving job for as
long as it runs; the operating system drops it when that process dies, however it dies, so a
requeued or resubmitted job never meets a stale lock. The file records who holds it (run id,
Slurm job id, host, pid, start time, command) so that the refusal names the other job.
``flock`` works across nodes where the shared file system supports it (Lustre mounted with
``-o flock``, NFSv4, GPFS); on one without it, only jobs on the same node are told apart.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
import uuid
from typing import Optional

__all__ = ["RunLock", "LOCK_NAME", "FolderInUseError"]

LOCK_NAME = ".axonmpi-run.lock"


class FolderInUseError(RuntimeError):
    """Another running job holds the checkpoint folder."""


def _describe(info: dict) -> str:
    job = info.get("slurm_job_id")
    return (f"{'Slurm job ' + str(job) + ', ' if job else ''}pid {info.get('pid', '?')} on {info.get('host', '?')}, "
            f"run id {info.get('run_id', '?')}, started {info.get('started', '?')}, "
            f"command: {info.get('command', '?')}")


class RunLock:
    """The lock of one checkpoint folder; :meth:`acquire` takes it or raises :class:`FolderInUseError`.

    Not collective (the :class:`~axonmpi.checkpoint.CheckpointManager` takes it on group rank 0 and
    shares the outcome). In one process several managers of one folder share the lock.

    Example:
        >>> lock = RunLock("checkpoints/gpt")
        >>> lock.acquire()                   # FolderInUseError naming the other job if one runs
        >>> lock.run_id
        '3f2a9c0d1b7e'
    """

    def __init__(self, directory: "str | os.PathLike", run_id: Optional[str] = None):
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, LOCK_NAME)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self._fd: Optional[int] = None
        self._shared = False   # another RunLock of this process holds the flock

    @property
    def held(self) -> bool:
        """True once :meth:`acquire` succeeded (by this object or another one of this process)."""
        return self._fd is not None or self._shared

    def holder(self) -> Optional[dict]:
        """What the lock file records about its (last) holder, or None."""
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.loads(f.read() or "null")
        except (OSError, ValueError):
            return None

    def acquire(self) -> None:
        """Take the lock (idempotent); raise :class:`FolderInUseError` naming the job holding it."""
        import fcntl
        if self.held:
            return
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise
            info = self.holder() or {}
            if info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
                self.run_id, self._shared = info.get("run_id", self.run_id), True   # another manager of ours
                return
            raise FolderInUseError(
                f"checkpoint folder {self.directory} is in use by another job ({_describe(info)}). Two jobs "
                "saving into one folder delete each other's saves: wait for that job to end or cancel it, or give "
                "this one another checkpoint folder (--checkpoint-dir)") from None
        info = {"run_id": self.run_id, "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "host": socket.gethostname(),
                "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd

    def check(self) -> None:
        """Check that the held lock still locks :attr:`path` (before each save); retake it or raise.

        Deleting the folder (or its lock file) while the job runs leaves this process holding an
        ``flock`` on a file that no longer has the path: the folder the next save recreates is
        unlocked and a second job would be admitted. When the lock file at the path is not the one
        held (device and inode differ, or it is gone), the lock is taken again on the path; when
        another job took it meanwhile, :class:`FolderInUseError` names the folder and that job.
        """
        if not self.held:
            return self.acquire()
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        if self._fd is not None:
            mine = os.fstat(self._fd)
            if st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                return
        elif st is not None and (self.holder() or {}).get("pid") == os.getpid():
            return                          # shared with another manager of this process, whose file is in place
        what = "was deleted" if st is None else "was deleted and made again"
        self.release()
        try:
            self.acquire()
        except FolderInUseError as e:
            raise FolderInUseError(
                f"checkpoint folder {self.directory}: its lock file {what} while this job ran (the folder was deleted "
                f"or emptied), and another job took the folder meanwhile: {e}") from None
        from ..log import get_logger
        get_logger(__name__).warning("checkpoint folder %s: its lock file %s while this job ran; the lock is "
                                     "taken again (run id %s)", self.directory, what, self.run_id)

    def release(self) -> None:
        """Drop the lock (the file stays, recording the last holder)."""
        if self._fd is not None:
            os.close(self._fd)   # closing the descriptor releases the flock
            self._fd = None
        self._shared = False

    def __repr__(self) -> str:
        return f"RunLock({self.directory!r}, run_id={self.run_id!r}, held={self.held})"
