"""Pipeline schedules as data, checked without MPI: completion, coverage, exact bubble and memory.

Time model of the simulator: every FORWARD action (one chunk, one micro-batch) takes 1, every
BACKWARD 2, transfers 0. A rank holding v chunks thus does v m (1 + 2) work, and the ideal
bubble is (p - 1) (1 + 2): idle = (p - 1) / (m + p - 1) for GPipe/1F1B (v = 1) and
(p - 1) / (v m + p - 1) for interleaved 1F1B.
"""
from fractions import Fraction

import numpy as np
import pytest

import axonmpi.nn as nn
from axonmpi.parallel.pipeline import (Action, ActionKind, PipelineSchedule, Schedule, ScheduleDeadlockError,
                                       format_schedule, make_schedule, simulate, split_module, split_points)

CASES = [(k, p, m, 1) for k in (PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B)
         for p in range(1, 5) for m in range(1, 9)]
CASES += [(PipelineSchedule.INTERLEAVED_ONE_F_ONE_B, p, m, v) for p in range(1, 5) for m in range(1, 9)
          for v in (2, 3) if m % p == 0]


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_schedule_completes_covers_and_has_the_ideal_bubble(kind, p, m, v):
    s = make_schedule(kind, p, m, v)
    r = simulate(s, forward_time=1, backward_time=2, comm_time=0)
    expected = Fraction(p - 1, v * m + p - 1)
    assert r.makespan == 3 * (v * m + p - 1)
    for rank in range(p):
        assert r.busy[rank] == 3 * v * m
        assert 1 - Fraction(r.busy[rank], r.makespan) == expected
        assert r.idle_fraction[rank] == float(expected)
        # every micro-batch passes every stage of this rank forward then backward, exactly once
        seen = {}
        for a in s.actions(rank):
            if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
                seen.setdefault((a.stage, a.microbatch), []).append(a.kind)
        assert seen == {(st, i): [ActionKind.FORWARD, ActionKind.BACKWARD]
                        for st in s.stages_of(rank) for i in range(m)}
    if kind is PipelineSchedule.ONE_F_ONE_B:
        assert r.peak_activations == [min(m, p - rank) for rank in range(p)]
    if kind is PipelineSchedule.GPIPE:
        assert r.peak_activations == [m] * p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6)])
def test_interleaved_shrinks_the_bubble_by_about_v(p, m):
    base = simulate(make_schedule("1f1b", p, m))
    # the same model cut into v chunks per rank: each chunk takes 1/v of the time
    for v in (2, 3):
        r = simulate(make_schedule("interleaved", p, m, v), forward_time=Fraction(1, v), backward_time=Fraction(2, v))
        assert (r.makespan - 3 * m) * v == base.makespan - 3 * m        # bubble time divided by exactly v


def test_transfers_surround_compute_and_match():
    s = make_schedule(PipelineSchedule.ONE_F_ONE_B, 3, 4)
    assert [str(a) for a in s.actions(1)[:6]] == ["1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1", "1F1", "1SEND_F1"]
    sends = {(a.kind, a.microbatch, a.stage) for r in range(3) for a in s.actions(r)
             if a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)}
    recvs = {(a.kind, a.microbatch, a.stage) for r in range(3) for a in s.actions(r)
             if a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)}
    assert {(ActionKind.RECV_ACT if k is ActionKind.SEND_ACT else ActionKind.RECV_GRAD, i,
             st + 1 if k is ActionKind.SEND_ACT else st - 1) for k, i, st in sends} == recvs
    assert str(Action(ActionKind.FORWARD, 0, 2)) == "2F0"


def test_comm_time_delays_the_pipeline():
    s = make_schedule("gpipe", 2, 2)
    assert simulate(s, comm_time=1).makespan == simulate(s).makespan + 2   # one hop each way


def test_broken_schedule_is_a_deadlock_naming_ranks():
    good = make_schedule("1f1b", 2, 2)
    # rank 1 waits for micro-batch 1 before micro-batch 0 is backwarded; rank 0 receives grads in order
    r0 = good.actions(0)
    r1 = [Action(ActionKind.RECV_ACT, 1, 1)] + [a for a in good.actions(1) if a != Action(ActionKind.RECV_ACT, 1, 1)]
    r0 = [Action(ActionKind.RECV_GRAD, 0, 0)] + [a for a in r0 if a != Action(ActionKind.RECV_GRAD, 0, 0)]
    with pytest.raises(ScheduleDeadlockError, match=r"(?s)ranks \[0, 1\].*rank 0 waits at 0RECV_B0.*rank 1 waits at 1RECV_F1"):
        simulate(Schedule(2, 2, 1, (tuple(r0), tuple(r1))))


def test_invalid_action_lists_are_refused():
    good = make_schedule("gpipe", 2, 1)
    missing = [a for a in good.actions(1) if a.kind is not ActionKind.RECV_ACT]
    with pytest.raises(ScheduleDeadlockError, match="rank 1: action 1F0.*no RECV_ACT"):
        simulate(Schedule(2, 1, 1, (tuple(good.actions(0)), tuple(missing))))
    wrong_rank = [Action(ActionKind.FORWARD, 0, 1)]
    with pytest.raises(ScheduleDeadlockError, match="not on rank 0"):
        simulate(Schedule(2, 1, 1, (tuple(wrong_rank), tuple(good.actions(1)))))


def test_make_schedule_errors():
    with pytest.raises(ValueError, match="multiple of num_stages.*num_microbatches=3, num_stages=2"):
        make_schedule(PipelineSchedule.INTERLEAVED_ONE_F_ONE_B, 2, 3, 2)
    with pytest.raises(ValueError, match="virtual_stages=2"):
        make_schedule(PipelineSchedule.ONE_F_ONE_B, 2, 4, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        make_schedule("zb", 2, 4)
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        make_schedule("gpipe", 2, 0)


def test_format_schedule_grid():
    text = format_schedule(make_schedule("gpipe", 2, 2))
    lines = text.splitlines()
    assert lines[1].split() == ["rank", "0", "0F0", "0F1", "0B0", "0B1"]
    assert lines[2].split() == ["rank", "1", "1F0", "1F1", "1B0", "1B1"]
    # rank 1 starts one step later: its first cell is blank
    assert lines[2].index("1F0") > lines[1].index("0F0")


def _mlp():
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4), nn.Tanh())


def test_split_by_params_layers_and_boundaries():
    model = _mlp()
    assert split_points(model, 2, by="layers") == [0, 3]
    assert split_points(model, 3, by="layers") == [0, 2, 4]
    # params 80, 0, 272, 0, 68, 0: the big middle layer gets a chunk of its own
    assert split_points(model, 3, by="params") == [0, 2, 3]
    assert split_points(model, 2, by="params") == [0, 2]     # 80 | 340 beats 352 | 68
    assert split_points(model, 2, boundaries=[5]) == [0, 5]
    chunks = [split_module(model, 3, rank=r)[0] for r in range(3)]
    assert sum(len(c) for c in chunks) == 6 and all(len(c) >= 1 for c in chunks)
    # the chunks hold the model's own parameter objects
    own = {id(q) for q in model.parameters()}
    assert {id(q) for c in chunks for q in c.parameters()} == own
    # virtual stages: rank r holds chunks r, r + p
    v = split_module(model, 2, virtual_stages=3, by="layers", rank=1)
    assert [c[0] for c in v] == [model[1], model[3], model[5]]


def test_split_errors():
    model = _mlp()
    with pytest.raises(ValueError, match="6 layers cannot fill 8 chunks"):
        split_points(model, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="boundaries must be 1 strictly increasing"):
        split_points(model, 2, boundaries=[0])
    with pytest.raises(ValueError, match="by must be 'params' or 'layers'"):
        split_points(model, 2, by="flops")
    lin = nn.Linear(4, 4)
    tied = nn.Sequential(lin, nn.ReLU(), lin)
    with pytest.raises(ValueError, match="a plain Pipeline would train the two stages. copies apart"):
        split_module(tied, 2, boundaries=[2], rank=0)


def _every_schedule():
    for kind in PipelineSchedule:
        v = 2 if kind in (PipelineSchedule.INTERLEAVED_ONE_F_ONE_B, PipelineSchedule.ZBV) else 1
        for p in range(1, 5):
            for m in (p, 2 * p, 2 * p + 1):
                if kind is PipelineSchedule.INTERLEAVED_ONE_F_ONE_B and m % p:
                    continue
                yield make_schedule(kind, p, m, v)


def test_receives_are_matched_in_each_peers_send_order():
    """[Note: p2p order]: NCCL matches a pair's messages by order alone, so the runtime posts each
    rank's receives in the order its peer sends them; that order covers every receive exactly once."""
    from axonmpi.parallel.pipeline.schedules import _check_fifo, _recv_order
    reordered = []
    for s in _every_schedule():
        _check_fifo(s)
        for r in range(s.num_stages):
            order = _recv_order(s, r)
            for q, recvs in order.items():
                sends = [a for a in s.actions(q) if a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)
                         and s.rank_of(a.stage + (1 if a.kind is ActionKind.SEND_ACT else -1)) == r]
                assert [(a.microbatch, a.stage + (1 if a.kind is ActionKind.SEND_ACT else -1)) for a in sends] \
                    == [(b.microbatch, b.stage) for b in recvs]
                own = [a for a in s.actions(r) if a in set(recvs)]
                assert sorted(own, key=str) == sorted(recvs, key=str)
                if own != recvs:
                    reordered.append((s.kind, s.num_stages, r, q))
            assert all(b.kind is ActionKind.RECV_ACT for bs in _recv_order(s, r, train=False).values() for b in bs)
    # the case that hung on NCCL: ZBV on 2 ranks receives a gradient before an activation sent earlier
    assert (PipelineSchedule.ZBV, 2, 1, 0) in reordered
    s = make_schedule("zbv", 2, 4)
    assert [str(b) for b in _recv_order(s, 1)[0]][:5] == ["1RECV_F0", "1RECV_F1", "1RECV_F2", "2RECV_B0", "2RECV_B1"]
    assert [str(a) for a in s.actions(1) if a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)][:4] \
        == ["1RECV_F0", "1RECV_F1", "2RECV_B0", "1RECV_F2"]


def test_a_receive_nobody_sends_is_refused_before_running():
    from axonmpi.parallel.pipeline.schedules import _check_fifo
    good = make_schedule("1f1b", 2, 2)
    extra = good.actions(1) + [Action(ActionKind.RECV_ACT, 1, 1)]
    with pytest.raises(ValueError, match=r"rank 1: its receives and its peers' sends to it differ"):
        _check_fifo(Schedule(2, 2, 1, (tuple(good.actions(0)), tuple(extra))))
