"""Restart inside the allocation with spare nodes (issue 53 item 3), under stub sbatch / srun / scontrol / sinfo: a
failed job step runs again with --auto-resume on the nodes Slurm reports healthy (a spare replaces the lost one);
with no healthy spare left the job is requeued; giving up removes the memory copies on every node; the time from
the failure to the first new step is logged (checkpoint.memory.log_restart_time)."""
import os
import subprocess
import sys

import pytest

from axonmpi.testing import mpiexec_env

from test_job_templates import ROOT, SBATCH, SCRIPT

SRUN = r'''#!/bin/bash
echo "srun $*" >> "$STUB_LOG"
if [[ " $* " == *" --auto-resume "* ]]; then
  n=$(cat "$STUB_LOG.count" 2>/dev/null || echo 0); echo $((n + 1)) > "$STUB_LOG.count"
  codes=($STUB_SRUN_EXITS); exit "${codes[$n]:-0}"
fi
'''
SCONTROL = r'''#!/bin/bash
echo "scontrol $*" >> "$STUB_LOG"
if [[ "$1 $2" == "show hostnames" ]]; then for i in $(seq 1 "$SLURM_NNODES"); do echo "n$i"; done; fi
'''
SINFO = r'''#!/bin/bash
# sinfo -h -n NODE -o %T: the nodes in STUB_DOWN (after the first job step) are down
node=$3
if [[ -f "$STUB_LOG.count" && " $STUB_DOWN " == *" $node "* ]]; then echo "down*"; else echo "allocated"; fi
'''


@pytest.fixture
def slurm(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("sbatch", SBATCH.replace("PYTHON", sys.executable)), ("srun", SRUN), ("scontrol", SCONTROL),
                       ("sinfo", SINFO)):
        (bin_ / name).write_text(text)
        os.chmod(bin_ / name, 0o755)
    log = tmp_path / "stub.log"

    def submit(*args, **env):
        log.write_text("")
        (tmp_path / "stub.log.count").unlink(missing_ok=True)
        e = mpiexec_env({"PATH": f"{bin_}:{os.environ['PATH']}", "STUB_LOG": str(log), "SCRIPT": SCRIPT,
                         "AXONMPI_SCRATCH": str(tmp_path / "scratch"),
                         "AXONMPI_SITE": os.path.join(ROOT, "jobs", "site.sh"),
                         **env})
        for k in [k for k in e if k.startswith("SLURM_")]:
            del e[k]
        r = subprocess.run(["sbatch", os.path.join(ROOT, "jobs", "slurm_ddp_multinode.sbatch"), *args],
                           capture_output=True, text=True, timeout=120, env=e, cwd=str(tmp_path))
        out = (tmp_path / "axonmpi-ddp-multi-4242.out").read_text()
        return r, log.read_text(), out

    return submit


@pytest.mark.serial
def test_a_lost_node_is_replaced_by_a_spare_and_the_step_resumes(slurm):
    # the template asks for 2 nodes of 4 tasks; one is the spare: job steps of 1 node (4 tasks); node n1 dies
    r, log, out = slurm("--spare-nodes", "1", "--steps", "9", STUB_SRUN_EXITS="3 0", STUB_DOWN="n1")
    assert r.returncode == 0, out + log
    runs = [ln for ln in log.splitlines() if ln.startswith("srun ") and "--auto-resume" in ln]
    assert len(runs) == 2, log
    assert "--nodes=1 --ntasks=4 --nodelist=n1 " in runs[0] and "--nodelist=n2 " in runs[1], runs
    assert all("--spare-nodes" not in r for r in runs) and runs[1].endswith("--steps 9")
    assert "node n1 is down*: left out of the job step" in out and "restart 1 of 2 inside allocation 4242" in out, out
    assert "scontrol requeue" not in log


@pytest.mark.serial
def test_no_healthy_spare_left_requeues_and_giving_up_removes_the_memory_copies(slurm):
    r, log, out = slurm("--steps", "9", SPARE_NODES="1", STUB_SRUN_EXITS="3 0", STUB_DOWN="n1 n2")
    assert r.returncode == 0 and "scontrol requeue 4242" in log, out + log
    assert "fewer than the job step's nodes are healthy" in out
    r, log, out = slurm("--steps", "9", STUB_SRUN_EXITS="3 3 3", AXONMPI_RESTARTS="2")
    assert r.returncode == 3, out + log
    assert "srun --ntasks-per-node=1 --nodes=2 rm -rf /dev/shm/axonmpi-slurm-4242" in log, log
    train = [ln for ln in log.splitlines() if "--auto-resume" in ln]
    assert len(train) == 3 and all("--nodelist" not in ln for ln in train)      # no spare nodes: srun as written


@pytest.mark.mpi(min_size=1)
def test_the_time_from_the_failure_to_the_first_new_step_is_logged(world, tmp_path_factory, monkeypatch):
    import time
    import numpy as np
    from axonmpi.checkpoint import memory
    import axonmpi
    d = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("restart")) if world.rank == 0 else None)
    monkeypatch.setenv("AXONMPI_FAILED_AT", str(time.time() - 2.0))
    monkeypatch.setenv("AXONMPI_RESTART", "1")
    said = []
    monkeypatch.setattr(memory, "log_restart_time", lambda log, what="resuming": said.append(what))
    mem = memory.MemoryCheckpointer("t", root=d)
    mem.save(7, {"w": np.ones(3)})
    mem.save(8, {"w": np.ones(3)})
    mem.close()
    assert said == ["the first step after it (step 7) is done"]
    said.clear()
    monkeypatch.undo()
    monkeypatch.setenv("AXONMPI_FAILED_AT", str(time.time() - 2.0))
    lines = []
    memory.log_restart_time(type("L", (), {"info": lambda self, m, *a: lines.append(m % a)})())
    assert lines and lines[0].startswith("restart ? inside the allocation: resuming "), lines
    assert "s after the failed job step" in lines[0]
