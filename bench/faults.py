"""Fault injection as a cluster user meets faults: how long each takes to end the job, its exit code.

Repeats the measurements of issue 22 at ``--ranks`` ranks (default 4) with ``AXONMPI_TIMEOUT``
set to ``--timeout`` seconds (default 5):

  * one rank skips one ``all_reduce`` in a loop (debug mode off, then on);
  * one rank stuck in user code;
  * ``sys.exit(3)`` / ``os._exit(0)`` on one rank while the others are in ``all_reduce``;
  * ``sys.exit(0)`` everywhere;
  * SIGTERM to ``examples/train_gpt.py`` mid-run, then ``--auto-resume``: the step it resumes at;
  * a checkpoint save onto a full disk (a small tmpfs, root only) at 1 rank and at ``--ranks``.
  * collective misuse with debug mode off (issue 31): an ``all_reduce`` of int32 on rank 0 and float32
    elsewhere, a ``broadcast`` with a different ``src`` on each rank, an ``all_reduce`` of 5 elements on
    rank 0 and 4 elsewhere, a ``recv`` nobody sends, a 32-byte ``send`` nobody receives;
  * SIGUSR1 to one rank right after ``init``, before its ``PreemptionHandler`` exists.

    python bench/faults.py --ranks 4
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from axonmpi.testing import mpiexec_env, mpiexec_path  # noqa: E402

SKIP = """
import numpy as np, axonmpi
w = axonmpi.init()
for step in range(6):
    if w.rank == 1 and step == 2:
        continue
    s = axonmpi.all_reduce(np.array([10.0 * step]))
"""
STUCK = """
import time, numpy as np, axonmpi
w = axonmpi.init()
axonmpi.all_reduce(np.ones(2))
if w.rank == w.world_size - 1:
    time.sleep(600)
axonmpi.all_reduce(np.ones(2))
"""
EXIT = """
import os, sys, time, numpy as np, axonmpi
w = axonmpi.init()
axonmpi.all_reduce(np.ones(2))
if w.rank == 1:
    {how}
axonmpi.all_reduce(np.ones(2))
"""

DTYPE = """
import numpy as np, axonmpi
w = axonmpi.init()
x = np.full(4, 1.5, np.float32) if w.rank else np.full(4, 1, np.int32)
print(w.rank, axonmpi.all_reduce(x), flush=True)
"""
SRC = """
import numpy as np, axonmpi
w = axonmpi.init()
print(w.rank, axonmpi.broadcast(np.full(4, w.rank + 1.0), src=w.rank), flush=True)
"""
COUNT = """
import numpy as np, axonmpi
w = axonmpi.init()
print(w.rank, axonmpi.all_reduce(np.ones(5 if w.rank == 0 else 4)), flush=True)
"""
UNSENT = """
import numpy as np, axonmpi
w = axonmpi.init()
if w.rank == 0:
    axonmpi.recv(np.empty(4), src=1)
"""
UNRECEIVED = """
import numpy as np, axonmpi
w = axonmpi.init()
if w.rank == 0:
    axonmpi.send(np.ones(4), dst=1)
"""
EARLY_USR1 = """
import os, signal, time, numpy as np, axonmpi
from axonmpi.checkpoint import PreemptionHandler
w = axonmpi.init()
if w.rank == 1:
    os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(0.2)
pre = PreemptionHandler()
stop = axonmpi.all_gather_object(pre.should_stop())
if w.rank == 0:
    print("should_stop() on every rank:", stop, flush=True)
if all(stop):
    pre.exit("signal during start-up")
"""


DISK_FULL = """
import os, shutil, sys, numpy as np, axonmpi
from axonmpi.checkpoint import CheckpointManager, training_state
from axonmpi.models import GPT, GPTConfig
w = axonmpi.init()
mgr = CheckpointManager(sys.argv[1])
mgr.save(1, {"w": np.arange(8.0)})
if w.rank == 0:   # fill the disk, leaving less than the GPT's checkpoint needs
    with open(os.path.join(os.path.dirname(sys.argv[1]), "filler"), "wb") as fh:
        fh.write(b"\\0" * max(0, shutil.disk_usage(sys.argv[1]).free - (192 << 10)))
axonmpi.barrier()
m = GPT(GPTConfig(vocab_size=94, block_size=32, n_layer=2, n_head=2, n_embd=64))
mgr.save(2, training_state(m, axonmpi.optim.AdamW(m.parameters()), step=2))
"""


def _disk_full(n, env, timeout):
    """(exit code, seconds, what it said, lines of output) of a save onto a 4 MiB tmpfs; None where mounting fails."""
    d = tempfile.mkdtemp(prefix="axonmpi-full-")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", d], capture_output=True).returncode:
        os.rmdir(d)
        return None
    try:
        t0 = time.monotonic()
        r = subprocess.run([mpiexec_path(), "-n", str(n), sys.executable, "-c", DISK_FULL, os.path.join(d, "run")],
                           capture_output=True, text=True, env=mpiexec_env(env), timeout=timeout)
        m = re.search(r"root cause: (rank \d+ of \d+ raised \w+: .{0,60})", r.stderr)
        said = m.group(1) if m else _said(r.stderr)
        return r.returncode, time.monotonic() - t0, said, len(r.stderr.splitlines())
    finally:   # ranks that MPI_Abort ended may still hold the mount for a moment: detach it lazily then
        if subprocess.run(["umount", d], capture_output=True).returncode:
            subprocess.run(["umount", "-l", d], capture_output=True)
        os.rmdir(d)


def _mpi(code, n, env, timeout):
    t0 = time.monotonic()
    try:
        r = subprocess.run([mpiexec_path(), "-n", str(n), sys.executable, "-c", code], capture_output=True,
                           text=True, env=mpiexec_env(env), timeout=timeout)
        rc, err = r.returncode, r.stderr + r.stdout
    except subprocess.TimeoutExpired:
        rc, err = "hang", ""
    return rc, time.monotonic() - t0, err


def _said(err):
    called = re.findall(r"(world ranks \[[^\]]*\] called [^\n]*?) call #", err)
    if called:
        return "CollectiveMismatchError: " + "; ".join(dict.fromkeys(called))
    for pat in (r"(rank \d+: \d+ send\(s\) to rank \d+ were never received)",
                r"\[axonmpi\] (rank \d+: the MPI library ended this process inside [^(]*)",
                r"(should_stop\(\) on every rank: [^\n]*)",
                r"\[axonmpi\] watchdog: (rank \d+ waited [^ ]+ s)", r"(Behind: rank \d+)",
                r"(rank \d+ exited[^\n]{0,60})", r"(\[axonmpi\][^\n]{0,80})"):
        m = re.search(pat, err)
        if m:
            return m.group(1)
    return err.strip().splitlines()[-1][:80] if err.strip() else ""


def _launch_until(cmd, env, when):
    """Run ``cmd``, SIGTERM it at the first output line for which ``when(line)`` is true; return
    (exit code, seconds from the signal to the end, the matching line, the output)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    t_sig, hit, out = None, None, []
    for line in p.stdout:
        out.append(line)
        if hit is None and when(line):
            hit, t_sig = line, time.monotonic()
            p.send_signal(signal.SIGTERM)
    p.wait(timeout=120)
    return p.returncode, time.monotonic() - (t_sig or time.monotonic()), hit, "".join(out)


def _preempt(n, timeout):
    d = tempfile.mkdtemp(prefix="axonmpi-faults-")
    cmd = [mpiexec_path(), "-n", str(n), sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"),
           "--checkpoint-dir", d, "--auto-resume", "--steps", "400", "--log-every", "1", "--no-progress"]
    env = mpiexec_env({"AXONMPI_TIMEOUT": str(timeout), "OMP_NUM_THREADS": "1"})

    def at_step(k):
        return lambda line: any(int(v) >= k for v in re.findall(r"\bstep\s+(\d+)", line))

    rc, took, hit, _ = _launch_until(cmd, env, at_step(30))
    seen = re.findall(r"\bstep\s+(\d+)", hit or "")
    _, _, _, out = _launch_until(cmd, env, lambda line: "resumed from" in line or "starting fresh" in line)
    m = re.search(r"resumed from \S+ at step (\d+)", out)
    return rc, took, (seen[0] if seen else "?"), (m.group(1) if m else "none (started fresh)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--skip-preemption", action="store_true")
    ap.add_argument("--only", default="", help="run only the cases whose name holds this text")
    args = ap.parse_args()
    n, t = args.ranks, args.timeout
    env = {"AXONMPI_TIMEOUT": str(t), "OMP_NUM_THREADS": "1"}
    cases = [
        ("one rank skips one all_reduce", SKIP, env),
        ("same, AXONMPI_DEBUG=1", SKIP, {**env, "AXONMPI_DEBUG": "1"}),
        ("one rank stuck in user code", STUCK, env),
        ("sys.exit(3) on rank 1", EXIT.format(how="sys.exit(3)"), env),
        ("os._exit(0) on rank 1", EXIT.format(how="os._exit(0)"), env),
        ("sys.exit(0) on every rank", EXIT.format(how="pass").replace("axonmpi.all_reduce(np.ones(2))\n", "", 1)
         + "sys.exit(0)\n", env),
        ("all_reduce int32 on rank 0, float32 elsewhere", DTYPE, env),
        ("broadcast with src=rank on each rank", SRC, env),
        ("all_reduce of 5 elements on rank 0, 4 elsewhere", COUNT, env),
        ("recv from rank 1, which never sends", UNSENT, env),
        ("32-byte send to rank 1, never received", UNRECEIVED, env),
        ("SIGUSR1 to rank 1 right after init", EARLY_USR1, env),
    ]
    print(f"{n} ranks, AXONMPI_TIMEOUT={t:g} s")
    print(f"| fault | exit code | seconds to end | first words |")
    print("| --- | ---: | ---: | --- |")
    for name, code, e in cases:
        if args.only and args.only not in name:
            continue
        rc, took, err = _mpi(code, n, e, timeout=10 * t + 60)
        print(f"| {name} | {rc} | {took:.1f} | {_said(err)} |", flush=True)
    for k in sorted({1, n}):
        got = _disk_full(k, env, timeout=10 * t + 60)
        if got is None:
            print(f"| disk full during a save, {k} rank(s) | not run: mounting a tmpfs is not allowed here | | |")
        else:
            rc, took, said, lines = got
            print(f"| disk full during a save, {k} rank(s) | {rc} | {took:.1f} | {said} ({lines} lines of stderr) |",
                  flush=True)
    if not args.skip_preemption:
        rc, took, seen, resumed = _preempt(n, t)
        print(f"| SIGTERM to train_gpt at step {seen} | {rc} | {took:.1f} | --auto-resume resumes at step "
              f"{resumed} |")


if __name__ == "__main__":
    main()
