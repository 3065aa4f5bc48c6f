"""A node killed at a random step (issue 53 item 4): the trainer (examples/train_gpt.py --memory-checkpoint-every 1)
resumes from the copies in node memory -- its own node's, or its buddy's for the lost node -- losing at most one
step, its losses bitwise equal to the uninterrupted run's, under DDP, FSDP and pipeline x tensor (x data) layouts.
"Nodes" are rank groups (AXONMPI_MEMORY_NODE_SIZE) with their own memory folder; a node is lost by deleting its
folder and ending the job in-process (an exception out of the training loop)."""
import json
import os
import shutil
import sys
import zlib

import numpy as np
import pytest

import axonmpi
from axonmpi.checkpoint import memory

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
TINY = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "8", "--corpus-bytes", "20000",
        "--eval-batches", "1", "--no-progress", "--sample-chars", "0", "--warmup", "2", "--dtype", "float64",
        "--log-every", "1", "--memory-checkpoint-every", "1"]
STEPS = 5


class _Killed(Exception):
    pass


def _losses(path):
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _run(world, d, layout, extra=(), kill_at=None, monkeypatch=None):
    import train_gpt
    if kill_at is not None:
        save = memory.MemoryCheckpointer.save

        def dying(self, step, state):
            save(self, step, state)
            if step == kill_at:       # the job dies here: the exchange of this step is never completed
                self.abandon()
                raise _Killed(step)
        monkeypatch.setattr(memory.MemoryCheckpointer, "save", dying)
    os.makedirs(d, exist_ok=True)
    if "--layout" in layout:
        axonmpi.distributed.destroy()        # the trainer makes the World with its grid
    try:
        train_gpt.main(TINY + list(layout) + ["--checkpoint-dir", d, "--steps", str(STEPS),
                                              "--global-batch", str(world.world_size),
                                              "--metrics-json", os.path.join(d, "m.jsonl")] + list(extra))
    except _Killed:
        pass
    finally:
        if kill_at is not None:
            monkeypatch.setattr(memory.MemoryCheckpointer, "save", save)
    return _losses(os.path.join(d, "m.jsonl")) if world.rank == 0 else None


LAYOUTS = {"ddp": [], "fsdp": ["--fsdp", "full_shard"], "pp-tp": ["--layout", "pp=2,tp=2,dp=1"],
           "pp-tp-dp": ["--layout", "pp=2,tp=2,dp=2"]}


def _lose_node(world, d, node, nodes_of):
    """Node ``node`` is gone: its memory folder deleted (by its first rank)."""
    axonmpi.barrier()
    if world.rank == nodes_of.index(node):
        key = open(os.path.join(d, ".axonmpi-run-key")).read().strip()
        shutil.rmtree(os.path.join(os.environ["AXONMPI_MEMORY_DIR"], f"axonmpi-{key}", f"node{node}"))
    axonmpi.barrier()


@pytest.fixture(autouse=True)
def _signal_handlers():
    """The trainer in process installs its preemption handlers: the next tests get the process' own back."""
    import signal
    names = [getattr(signal, n) for n in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP") if hasattr(signal, n)]
    saved = {s: signal.getsignal(s) for s in names}
    yield
    for s, h in saved.items():
        if h is not None:
            signal.signal(s, h)


@pytest.fixture
def fresh_world():
    """The layouts take their own grid: the World is made again by the trainer, and as it was after the test."""
    yield
    axonmpi.distributed.destroy()
    axonmpi.init()


def _check(world, tmp_path_factory, monkeypatch, layout):
    base = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("memresume")) if world.rank == 0 else None)
    monkeypatch.setenv("AXONMPI_MEMORY_DIR", os.path.join(base, "shm"))
    per = world.world_size // 2
    monkeypatch.setenv("AXONMPI_MEMORY_NODE_SIZE", str(per))
    nodes_of = [r // per for r in range(world.world_size)]
    want = _run(world, os.path.join(base, "a"), LAYOUTS[layout], ["--no-save"])    # uninterrupted
    kill_at = int(np.random.default_rng(zlib.crc32(layout.encode())).integers(2, STEPS))   # a random step
    d = os.path.join(base, "b")
    _run(world, d, LAYOUTS[layout], kill_at=kill_at, monkeypatch=monkeypatch)
    _lose_node(world, d, 1, nodes_of)
    got = _run(world, d, LAYOUTS[layout], ["--auto-resume"])
    problem = None
    if world.rank == 0:           # rank 0 checks; every rank raises the outcome
        text = open(os.path.join(d, "train.log")).read()
        key = open(os.path.join(d, ".axonmpi-run-key")).read().strip()
        if "resumed from node memory, step" not in text:
            problem = "not resumed from memory: " + text[-2000:]
        else:
            resumed = int(text.split("resumed from node memory, step ")[1].split()[0])
            steps = range(resumed + 1, STEPS + 1)
            if resumed < kill_at - 1:
                problem = f"resumed at step {resumed} after a kill at {kill_at}: more than one step lost"
            elif [got[s] for s in steps] != [want[s] for s in steps]:
                problem = f"losses after the resume differ: {[got[s] for s in steps]} vs {[want[s] for s in steps]}"
            elif os.path.exists(os.path.join(base, "shm", f"axonmpi-{key}", "node0")):
                problem = "the memory copies were not removed at the clean end"
    problem = axonmpi.broadcast_object(problem)
    assert problem is None, problem


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "pp-tp"])
def test_a_lost_node_costs_at_most_one_step_and_the_losses_are_bitwise(world, tmp_path_factory, monkeypatch, layout,
                                                                      fresh_world):
    if world.world_size != 4:
        pytest.skip("4 ranks: two nodes of two")
    _check(world, tmp_path_factory, monkeypatch, layout)


@pytest.mark.nd
@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", [pytest.param("ddp", marks=pytest.mark.slow),     # the 4-rank test's kinds
                                    pytest.param("fsdp", marks=pytest.mark.slow), "pp-tp-dp"])
def test_a_lost_node_at_8_ranks(world, tmp_path_factory, monkeypatch, layout, fresh_world):
    if world.world_size != 8:
        pytest.skip("8 ranks: two nodes of four")
    _check(world, tmp_path_factory, monkeypatch, layout)
