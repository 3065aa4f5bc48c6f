"""Zero-bubble schedules (ZB-H1, ZBV) as data, checked in the simulator without processes.

The bubble is the zero-bubble paper's (Qi et al., ICLR 2024): per rank, the idle time between its
first action's start and its last action's end; the schedule's bubble is the largest. With F, B and
W the times of a forward, an input-gradient and a weight-gradient pass (an unsplit backward takes
B + W): 1F1B's bubble is (p - 1)(F + B + W) and ZB-H1's (p - 1)(F + B - W), a third of 1F1B's when
F = B = W; ZBV's is 0 with F = B = W once m >= 2p - 1 (its steady state). Peak activations (in
micro-batches x chunks held from F to W): ZB-H1's largest equals 1F1B's (p); ZBV holds 2p chunk
micro-batches on every rank, i.e. p micro-batches of the rank's whole model: 1F1B's peak, balanced.
"""
from fractions import Fraction

import pytest

from axonmpi.parallel.pipeline import (Action, ActionKind, PipelineSchedule, Schedule, ScheduleDeadlockError,
                                       format_schedule, make_schedule, simulate)

PM = [(p, m) for p in range(2, 9) for m in range(p, 4 * p + 1)]
TIMES = [(1, 1, 1), (2, 3, 1), (3, 2, 2), (1, 2, 1), (5, 3, 2), (2, 1, 1)]


def _split_coverage(s):
    for r in range(s.num_stages):
        seen = {}
        for a in s.actions(r):
            if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT,
                          ActionKind.BACKWARD):
                seen.setdefault((a.stage, a.microbatch), []).append(a.kind)
        assert seen == {(st, i): [ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT]
                        for st in s.stages_of(r) for i in range(s.num_microbatches)}


@pytest.mark.parametrize("F,B,W", TIMES)
def test_zb_h1_reproduces_the_published_bubble_and_1f1b_memory(F, B, W):
    for p, m in PM:
        base = simulate(make_schedule(PipelineSchedule.ONE_F_ONE_B, p, m), F, B, 0, W)
        s = make_schedule(PipelineSchedule.ZB_H1, p, m)
        r = simulate(s, F, B, 0, W)
        assert max(base.bubble) == (p - 1) * (F + B + W), (p, m)
        assert max(r.bubble) == (p - 1) * (F + B - W), (p, m)
        assert r.busy == [m * (F + B + W)] * p
        assert max(r.peak_activations) == max(base.peak_activations) == p
        assert all(k <= p for k in r.peak_activations)


def test_zb_h1_is_a_third_of_1f1b_when_f_b_w_are_equal():
    for p, m in PM:
        z = simulate(make_schedule("zb-h1", p, m), 1, 1, 0, 1)
        o = simulate(make_schedule("1f1b", p, m), 1, 1, 0, 1)
        assert 3 * max(z.bubble) == max(o.bubble) == 3 * (p - 1)
        _split_coverage(make_schedule("zb-h1", p, m))


def test_zbv_has_no_bubble_in_steady_state_and_1f1b_memory():
    for p, m in PM:
        s = make_schedule(PipelineSchedule.ZBV, p, m)
        assert s.virtual_stages == 2 and s.stages_of(0) == [0, 2 * p - 1] and s.rank_of(p) == p - 1
        _split_coverage(s)
        r = simulate(s, 1, 1, 0, 1)
        assert r.busy == [2 * m * 3] * p
        if m >= 2 * p - 1:
            assert r.bubble == [0] * p, (p, m)
            assert r.peak_activations == [2 * p] * p
        else:   # fewer micro-batches than the V needs to fill: 2 (2p - 1 - m) units on the worst rank
            assert max(r.bubble) == 2 * (2 * p - 1 - m), (p, m)
            assert max(r.peak_activations) <= 2 * p


def test_zbv_halves_the_chunk_and_beats_zb_h1():
    """The same model: ZBV's chunks are half a ZB-H1 stage, so F, B, W halve."""
    for p, m in [(4, 8), (4, 16), (3, 9)]:
        h1 = simulate(make_schedule("zb-h1", p, m), 2, 2, 0, 2)
        v = simulate(make_schedule("zbv", p, m), 1, 1, 0, 1)
        assert max(v.bubble) == 0 < max(h1.bubble)


def test_zero_bubble_transfers_follow_the_input_gradient():
    s = make_schedule("zb-h1", 3, 4)
    acts = [str(a) for a in s.actions(1)]
    assert acts[acts.index("1I0") - 1] == "1RECV_B0" and acts[acts.index("1I0") + 1] == "1SEND_B0"
    assert "1RECV_B0" not in acts[acts.index("1I0") + 1:]
    v = make_schedule("zbv", 2, 3)
    # the V's bottom (stages 1 and 2) is on rank 1: a local hand-off, no transfer
    assert not any(a.stage in (1, 2) and a.kind in (ActionKind.SEND_ACT, ActionKind.RECV_ACT) and
                   (a.kind is ActionKind.SEND_ACT) == (a.stage == 1) for a in v.actions(1))
    assert Action(ActionKind.SEND_ACT, 0, 0) in v.actions(0) and Action(ActionKind.RECV_ACT, 0, 3) in v.actions(0)


def test_format_schedule_draws_i_and_w():
    text = format_schedule(make_schedule("zb-h1", 2, 2))
    rows = text.splitlines()
    assert rows[1].split()[2:] == ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"]
    assert rows[2].split()[2:] == ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]
    zbv = format_schedule(make_schedule("zbv", 2, 3))
    assert "3I0" in zbv and "3W0" in zbv and len(zbv.splitlines()) == 3


def test_w_before_i_or_missing_w_is_refused():
    p = 1
    ok = [Action(ActionKind.FORWARD, 0, 0), Action(ActionKind.BACKWARD_INPUT, 0, 0),
          Action(ActionKind.BACKWARD_WEIGHT, 0, 0)]
    simulate(Schedule(p, 1, 1, (tuple(ok),)))
    with pytest.raises(ScheduleDeadlockError, match="before 0I0"):
        simulate(Schedule(p, 1, 1, ((ok[0], ok[2], ok[1]),)))
    with pytest.raises(ScheduleDeadlockError, match="never 0W0"):
        simulate(Schedule(p, 1, 1, (tuple(ok[:2]),)))
    with pytest.raises(ScheduleDeadlockError, match="second time"):
        simulate(Schedule(p, 1, 1, ((ok[0], ok[1], Action(ActionKind.BACKWARD, 0, 0), ok[2]),)))


def test_zero_bubble_errors_and_names():
    assert PipelineSchedule.parse("zb-h1") is PipelineSchedule.ZB_H1
    assert PipelineSchedule.parse("ZBV") is PipelineSchedule.ZBV
    with pytest.raises(ValueError, match="virtual_stages=3"):
        make_schedule("zbv", 2, 4, virtual_stages=3)
    with pytest.raises(ValueError, match="virtual_stages=2"):
        make_schedule("zb-h1", 2, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="stage_ranks"):
        Schedule(2, 1, 2, ((), ()), None, (0, 1, 1, 1))
