"""The planner's one cost model on a measured machine (axonmpi/planner/estimate.py) against hand-computed cases,
and the plan/plot commands: the layout strings the planner prints are its input, --top in --json, --measure's load."""
import json
import os
import subprocess
import sys

import pytest

from axonmpi.planner import ParallelLayout, TrainConfig, TransformerConfig, estimate_layout
from axonmpi.planner.axonn import linear_volumes
from axonmpi.planner.measure import check_load, hardware_from_measured
from axonmpi.planner.search import candidates, search

# 2 blocks, width 4, one head, sequence 2, vocabulary 8, untied head: Linears (4,12) (4,4) (4,16) (16,4): 192 weights,
# 36 biases and two LayerNorms (16) = 244 a block; 2*244 + (8+2)*4 embeddings + 8 ln_f + 8*4 head = 568 in all
M = TransformerConfig(layers=2, width=4, heads=1, seq=2, vocab=8, tied=False)
#: a measured machine with round numbers: 1 kB/s inside a node of 4 ranks, 100 B/s between nodes, 1 kflop/s
HW = hardware_from_measured({"intra": 1e3, "inter": 1e2, "flops": 1e3, "latency": 0.0, "cores": 0.0}, 4)


def train(batch=4, micro=1):
    return TrainConfig(batch, micro, "fp32", "none", dropout=False)


def est(text, batch=4, micro=1, hw=HW):
    return estimate_layout(M, train(batch, micro), ParallelLayout.parse(text), hw)


@pytest.mark.serial
def test_linear_volumes_are_the_easy_mode_closed_forms():
    # n=4 rows, in=8, out=16 on G_r = G_c = G_d = 2
    v = linear_volumes(8, 16, 4, 2, 2, 2)
    assert v["col"] == {"allreduce": 2 * 4 * 16, "gather": 2 * 4 * 8 + 2 * 4 * 16}     # AR out; a2a in x2, AG out
    assert v["row"] == {"allreduce": 2 * 4 * 8, "gather": 2 * 4 * 8 + 2 * 2 * 4 * 16}  # AR dX; AG in, a2a out x2
    assert v["depth"] == {"gather": 2 * 8 * 16 / 4}                                    # weight AG + dW RS
    assert linear_volumes(8, 16, 4, 1, 1, 1) == {"col": {}, "row": {}, "depth": {}}
    assert linear_volumes(8, 16, 4, 1, 1, 2) == {"col": {}, "row": {}, "depth": {"gather": 256.0}}   # no easy mode
    assert M.layer_params == 244 and M.params == 568


@pytest.mark.serial
def test_the_old_module_keeps_what_moved_and_names_what_went():
    import axonmpi.plan as P
    from axonmpi.planner.moe import moe_estimate
    assert P.moe_estimate is moe_estimate and P.linear_volumes is linear_volumes
    with pytest.raises(AttributeError, match="one cost model now, in axonmpi.planner; use axonmpi.planner.estimate_layout"):
        P.estimate
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        P.nothing


@pytest.mark.serial
def test_row_split_by_hand():
    e = est("row=2,col=1,depth=1,pp=1,dp=1", micro=2)        # one micro-batch of 2 rows: n = 4 tokens a rank
    # per Linear 2 G_r n in + 2 n out = 16 in + 8 out: blocks 2*(16*28 + 8*36), head (4, 8): 64 + 64; the replicated
    # LayerNorms and embeddings (80) over all ranks; bytes of 4
    assert e.volumes["row"] == 4 * (2 * (16 * 28 + 8 * 36) + 128.0) and e.volumes["repl"] == 4 * 80.0
    assert e.volumes["col"] == e.volumes["depth"] == e.volumes["data"] == 0
    # all-reduce part G_r n in = 8 in: 2*8*28 + 32 = 480 at 2 (p-1)/p = 1; the rest at (p-1)/p = 1/2
    assert e.breakdown["tp_comm_s"] == pytest.approx((480 + 0.5 * (1600 - 480)) * 4 / 1e3)
    assert e.breakdown["dp_exposed_s"] == pytest.approx(80 * 4 / 1e3)         # the replicated gradients, exposed
    # 6 n sum(in out) + 12 n S H a block, the head 6 n 32: 2 (4608 + 384) + 768 flops at 1e3 flop/s
    assert e.breakdown["compute_s"] == pytest.approx(10752 / 1e3)
    assert e.step_time == pytest.approx(10.752 + 4.16 + 0.32)
    # fp32 weights, gradients and two AdamW moments: 16 bytes x local parameters (40 embeddings + 2 x (16 + 30 + 10
    # + 40 + 34) + 8 + 16)
    assert e.memory["state"] == 16 * 324


@pytest.mark.serial
def test_depth_data_fsdp_and_pipeline_by_hand():
    e = est("row=1,col=1,depth=2,pp=1,dp=1", micro=2)
    assert e.volumes["depth"] == 4 * (2 * 2 * 192 + 2 * 32 + 2 * 36)   # weights gathered + scattered, bias all-reduce
    # the weights' gathers and scatters at (p-1)/p, the biases' all-reduce at 2 (p-1)/p, the replicated 80 likewise
    assert e.breakdown["tp_comm_s"] + e.breakdown["dp_exposed_s"] == pytest.approx((0.5 * 832 + 72 + 80) * 4 / 1e3)
    e = est("row=1,col=1,depth=2,pp=1,dp=1", batch=12, micro=2)            # 3 micro-batches
    assert e.volumes["depth"] == 4 * (3 * 832 + 72)                         # the weight again every micro-batch
    e = est("tp=1,pp=1,dp=2", micro=2)
    assert e.volumes["data"] == 4 * 568.0                                    # DDP: the whole gradient
    assert e.breakdown["dp_exposed_s"] == pytest.approx(568 * 4 / 1e3)      # 2 (p-1)/p = 1, no overlap on a CPU
    e = est("tp=1,pp=1,dp=2,zero=3", micro=2)
    assert e.volumes["data"] == 4 * 3 * 568 and e.breakdown["dp_comm_s"] == pytest.approx(0.5 * 1704 * 4 / 1e3)
    assert est("tp=1,pp=1,dp=2,zero=2", micro=2).volumes["data"] == 4 * 2 * 568          # gathered once, kept
    e = est("tp=1,pp=2,dp=1,schedule=1f1b", micro=2)                         # 2 micro-batches of 2
    # each stage sends and receives n H = 4*4 once each way per micro-batch
    assert e.volumes["pipeline"] == 4 * 4 * 16.0
    # the slower stage: a block 6*4*192 + 12*4*2*4 = 4992 a micro-batch plus the head 6*4*32 = 768; the 1F1B bubble
    # adds one more micro-batch's chunk (p - 1 = 1 of them), its two transfers (64 bytes at 1 kB/s) included
    assert e.breakdown["compute_s"] == pytest.approx(2 * (4992 + 768) / 1e3)
    assert e.breakdown["bubble_s"] == pytest.approx(4992 / 1e3 + 2 * 64 / 1e3)
    # FSDP over data x AxoNN columns: TP-local parameters (embeddings 40, blocks 16 + 24+12 + 8+4 + 32+16 + 32+4,
    # ln_f 8 + head 32/2) = 360 gathered twice and reduce-scattered over data; the replicated ones reduced over
    # the tensor block on each rank's data shard: units wte 32 | wpe 8 | block 148 (ln_1 at 0, ln_2 at 56, both
    # in chunk 0 = [0, 74)) x 2 | ln_f 8 | head 16 (split): rank 0 16 + 4 + 2 x 16 + 4 = 56, rank 1 16 + 4 + 4 = 24
    tp = est("row=1,col=2,depth=1,pp=1,dp=2", batch=8, micro=2)
    e = est("row=1,col=2,depth=1,pp=1,dp=2,zero=3", batch=8, micro=2)
    assert e.volumes == {**tp.volumes, "data": 4 * 3 * 360.0, "repl": 4 * 56.0}
    assert est("row=1,col=2,depth=1,pp=1,dp=2,zero=2", batch=8, micro=2).volumes["data"] == 4 * 2 * 360.0
    # every micro-batch gathers and reduce-scatters again (FSDP without no_sync)
    assert est("row=1,col=2,depth=1,pp=1,dp=2,zero=3", batch=8, micro=1).volumes["data"] == 2 * 4 * 3 * 360.0


@pytest.mark.serial
def test_placement_latency_and_shared_cores():
    # grid order col, row, depth, pipeline, data: 4 columns fill a node of 4, the data pairs span two nodes
    e = est("row=1,col=4,depth=1,pp=1,dp=2", batch=16, micro=2)
    # 3-D weight shards and biases, the head's, and the replicated parameters (then also over the tensor block)
    assert e.volumes["data"] == 4 * (2 * (192 / 4 + 36) + 32 / 4 + 80) and e.volumes["repl"] == 4 * 80
    assert e.breakdown["dp_exposed_s"] > e.volumes["data"] / 1e2          # at the network's 100 B/s
    lat = hardware_from_measured({"intra": 1e3, "inter": 1e2, "flops": 1e3, "latency": 1.0, "cores": 0.0}, 4)
    a, b = est("row=1,col=2,depth=1,pp=1,dp=2", batch=16, micro=4, hw=lat), est("row=1,col=2,depth=1,pp=1,dp=2",
                                                                                  batch=16, micro=4)
    # 5 calls on col per split Linear (9 of them: the head's too), one per gradient tensor on data (8 weights + 8
    # biases + the head's weight, and the 12 replicated ones: 2 embeddings + 2 x 4 LayerNorm + ln_f 2), one per
    # replicated tensor over the tensor block (parallel/grad_sync.py's table: data, then the batch group)
    assert a.step_time - b.step_time == pytest.approx(45 + 17 + 12 + 12)
    two = hardware_from_measured({"intra": 1e3, "inter": 1e2, "flops": 1e3, "latency": 0.0, "cores": 2.0}, 4)
    shared = est("tp=1,pp=1,dp=4", batch=16, micro=4, hw=two)
    assert shared.breakdown["compute_s"] == pytest.approx(2 * est("tp=1,pp=1,dp=4", batch=16, micro=4).breakdown["compute_s"])


@pytest.mark.serial
def test_reductions_after_the_backward_take_the_back_to_back_rates():
    """DDP's buckets and AxoNN's per-tensor gradient all-reduces run after the backward, all ranks arriving
    together, back to back and in place: a machine measured with ``bucket`` / ``bucket_latency`` charges them
    at those; FSDP's gathers and reduce-scatters (between the units' compute) keep the between-GEMM rates."""
    base = {"intra": 1e3, "inter": 1e2, "flops": 1e3, "latency": 1.0, "cores": 0.0}
    old = hardware_from_measured(base, 4)
    new = hardware_from_measured({**base, "bucket": 4e3, "bucket_latency": 0.25}, 4)
    # DDP over 4 ranks of a node: one bucket of 568 float32 gradients, 2 (p-1)/p of it through each rank's link
    a, b = est("tp=1,pp=1,dp=4", batch=16, hw=old), est("tp=1,pp=1,dp=4", batch=16, hw=new)
    assert a.breakdown["dp_exposed_s"] == pytest.approx(1.5 * 568 * 4 / 1e3 + 1.0)
    assert b.breakdown["dp_exposed_s"] == pytest.approx(1.5 * 568 * 4 / 4e3 + 0.25)
    # AxoNN columns x data: 17 + 12 gradient tensors over data, 12 replicated ones over the tensor block: one
    # call each, at the back-to-back latency (the column group's forward/backward calls keep the other one)
    c, d = est("row=1,col=2,depth=1,pp=1,dp=2", batch=16, micro=4, hw=old), est(
        "row=1,col=2,depth=1,pp=1,dp=2", batch=16, micro=4, hw=new)
    assert c.breakdown["dp_exposed_s"] - d.breakdown["dp_exposed_s"] > (17 + 12 + 12) * 0.75
    assert c.breakdown["tp_comm_s"] == pytest.approx(d.breakdown["tp_comm_s"])
    # FSDP full shard: its gathers and reduce-scatters between the units' compute are charged as before
    e, f = est("tp=1,pp=1,dp=4,zero=3", batch=16, hw=old), est("tp=1,pp=1,dp=4,zero=3", batch=16, hw=new)
    assert e.breakdown["dp_exposed_s"] == pytest.approx(f.breakdown["dp_exposed_s"])


@pytest.mark.serial
def test_the_other_kernels_by_hand():
    """The CPU costs besides the GEMMs, per kind: GELU per MLP element, LayerNorm per element (two a block, the
    final one), softmax per attention score (and the loss's), residual adds (memory-bound); AdamW over the updated
    parameters and two copies of every all-reduced gradient."""
    kern = dict(attn_flops=100.0, gelu=1.0, layernorm=2.0, softmax=3.0, add=5.0, adam=7.0, copy=11.0, mem_cores=0.5)
    hw = hardware_from_measured({"intra": 1e3, "inter": 1e2, "flops": 1e3, "latency": 0.0, "cores": 1.0, **kern}, 4)
    e = est("tp=1,pp=1,dp=2", micro=2, hw=hw)         # n = 4 tokens a rank, one head, 2 ranks on the node
    gemm = 6 * 4 * (2 * 192 + 4 * 8) / 1e3             # the Linears (the head's included)
    attn = 12 * 4 * 2 * 4 * 2 / 100.0                  # 12 n S H a block
    other = 2 * (64 * 1.0 + 32 * 2.0 + 8 * 3.0) + 16 * 2.0 + 32 * 3.0   # blocks, final LayerNorm, the loss's softmax
    adds = 2 * 2 * 4 * 4 * 5.0                          # 2 adds of n H a block
    assert e.breakdown["compute_s"] == pytest.approx((gemm + attn + other) * 2 + adds * 4)   # ranks / cores, / mem_cores
    assert e.breakdown["optimizer_s"] == pytest.approx((568 * 7.0 + 2 * 568 * 11.0) * 4)
    f = est("tp=1,pp=1,dp=2,zero=3", micro=2, hw=hw)    # AdamW on the shard; no flat all-reduce
    assert f.breakdown["optimizer_s"] == pytest.approx(284 * 7.0 * 4)


@pytest.mark.serial
def test_sharded_data_parallel_as_it_runs():
    """FSDP's collectives per unit and micro-batch, what prefetching hides and what it cannot (the first gather,
    the last reduce-scatter, gathers that outrun a small unit's compute), hybrid shard, and memory per layout."""
    from axonmpi.planner import load_hardware
    a100 = load_hardware("dgx-a100")
    cfg = TransformerConfig(layers=8, width=2048, heads=16, seq=2048)
    t = TrainConfig(64, 1, "bf16", "full")
    lays = {k: estimate_layout(cfg, t, ParallelLayout.parse(f"tp=1,pp=1,dp=64,{k}"), a100)
            for k in ("zero=0", "zero=1", "zero=2", "zero=3", "zero=3,shard=8", "zero=3,overlap=0")}
    P = lays["zero=0"].breakdown["params_per_rank"]
    assert lays["zero=3"].volumes["data"] == 3 * P * 2 and lays["zero=2"].volumes["data"] == 2 * P * 2
    assert lays["zero=1"].volumes["data"] == 2 * P * 2                 # DDP's all-reduce + the all-gather after step
    assert lays["zero=3,shard=8"].volumes["data"] == (3 * P + P / 8) * 2   # + the shard's all-reduce over replicas
    z3, no = lays["zero=3"], lays["zero=3,overlap=0"]
    assert 0 < z3.breakdown["dp_exposed_s"] < z3.breakdown["dp_comm_s"] == pytest.approx(no.breakdown["dp_exposed_s"])
    # the node's NVLink carries a hybrid shard's gathers: faster than the same gathers through the network cards
    assert lays["zero=3,shard=8"].breakdown["dp_comm_s"] < z3.breakdown["dp_comm_s"]
    mem = {k: e.memory["state"] for k, e in lays.items()}
    assert mem["zero=0"] > mem["zero=1"] > mem["zero=2"] > mem["zero=3"]
    # a group across nodes gets the network bandwidth per GPU: one card's, whatever its ranks per node
    from axonmpi.planner.calibration import FITTED
    from axonmpi.planner.comm import group_bandwidth
    assert group_bandwidth(64, 1, a100, FITTED) == group_bandwidth(8, 8, a100, FITTED) == a100.nic_bw * FITTED.network
    # too little compute per unit: the gathers outrun it and show (a short sequence, same bytes)
    small = estimate_layout(TransformerConfig(layers=8, width=2048, heads=16, seq=64), TrainConfig(64, 1, "bf16", "full"),
                            ParallelLayout(dp=64, zero=3), a100)
    assert small.breakdown["dp_exposed_s"] > 0.5 * small.breakdown["dp_comm_s"]


@pytest.mark.serial
def test_candidates_follow_the_rules_and_search_is_sorted():
    got = list(candidates(M, train(), 4, HW))
    for lay in got:
        assert lay.world == 4 and ParallelLayout.parse(lay.label()) == lay
    assert ParallelLayout(pp=2, dp=2, schedule="1f1b") in got and ParallelLayout(dp=4, zero=3) in got
    assert ParallelLayout(col=3) not in set(candidates(M, train(), 3, HW))      # in = 4 does not divide by 3
    res = search(M, train(8), 4, HW)
    assert [e.step_time for e in res] == sorted(e.step_time for e in res) and len(res) > 10
    assert search(M, train(8), 4, HW, memory_limit=0) == []


def _cli(*args, **kw):
    from axonmpi.testing import mpiexec_env
    return subprocess.run([sys.executable, "-m", "axonmpi", *args], capture_output=True, text=True, timeout=120,
                          env=mpiexec_env(), **kw)


SMALL = ["plan", "--world", "4", "--layers", "4", "--width", "64", "--seq", "8", "--global-batch", "8",
         "--vocab", "95", "--hardware", "cpu"]


@pytest.mark.serial
def test_every_layout_the_plan_prints_is_accepted_by_layout(capsys):
    """The table's and the JSON's layout strings go back in through --layout and give the same estimate
    (the table printed `...,schedule=zbv,zbv` before)."""
    from axonmpi.cli import main
    for hw in (["--hardware", "cpu"], ["--hardware", "dgx-a100", "--world", "16", "--heads", "8"]):
        args = SMALL[:-2] + hw + ["--top", "40"]
        assert main(args + ["--json"]) == 0
        lays = json.loads(capsys.readouterr().out)["layouts"]
        assert main(args) == 0
        table = [line.split()[1] for line in capsys.readouterr().out.splitlines()[2:] if line.split()[0].isdigit()]
        assert table == [x["label"] for x in lays] and any("schedule=zbv" in x for x in table)
        for x in lays:
            assert main(args + ["--json", "--layout", x["label"]]) == 0, x["label"]
            (back,) = json.loads(capsys.readouterr().out)["layouts"]
            assert back["label"] == x["label"] and back["step_time_s"] == pytest.approx(x["step_time_s"], rel=1e-12)


@pytest.mark.serial
def test_top_is_honoured_in_json(capsys):
    from axonmpi.cli import main
    assert main(SMALL + ["--json", "--top", "3"]) == 0
    three = json.loads(capsys.readouterr().out)["layouts"]
    assert main(SMALL + ["--json", "--top", "500"]) == 0
    every = json.loads(capsys.readouterr().out)["layouts"]
    assert len(three) == 3 and len(every) > 3 and three == every[:3]


@pytest.mark.serial
def test_measure_reports_the_load_and_refuses_to_save_under_load(tmp_path, monkeypatch, capsys):
    assert check_load(15.0, 2) and "load average 15.0 on 2 cores" in check_load(15.0, 2)
    assert check_load(2.0, 2) is None
    from axonmpi.cli import main
    from axonmpi.planner import measure
    monkeypatch.setattr(measure, "load_report", lambda: (15.0, 2))
    saved = tmp_path / "hw.json"
    assert main(SMALL[:-2] + ["--measure", "--save-hardware", str(saved)]) == 1
    err = capsys.readouterr().err
    assert "refusing to --save-hardware: load average 15.0 on 2 cores" in err and "--allow-load" in err, err
    assert not saved.exists()


@pytest.mark.serial
def test_plan_and_plot_commands(tmp_path):
    r = _cli(*SMALL, "--top", "3")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "step s" in lines[1] and len(lines) == 6 and lines[2].split()[0] == "1"
    assert lines[5].startswith("kernels assumed:")
    from axonmpi.testing import run_mpiexec
    saved = tmp_path / "cpu.json"
    r = run_mpiexec(["-m", "axonmpi", "plan", "--world", "2", "--layers", "2", "--width", "64", "--seq", "8",
                     "--global-batch", "4", "--heads", "2", "--measure", "--save-hardware", str(saved), "--allow-load"],
                    n=2, timeout=120)
    assert r.returncode == 0 and "measured on 2 ranks (2 per node) under load average" in r.stdout, r.stderr
    from axonmpi.planner import load_hardware        # the kernels measured, saved and read back
    hw = load_hardware(str(saved))
    assert hw.is_measured and all(hw.kernel(k) > 0 for k in ("gelu", "layernorm", "softmax", "add", "adam", "copy",
                                                             "attn_flops", "flops"))
    assert 0 < hw.mem_cores() <= (os.cpu_count() or 1)
    spec = json.loads(saved.read_text())        # the run's ranks per node, not the default 8; the load it had
    assert spec["gpus_per_node"] == 2 and hw.gpus_per_node == 2 and spec["load_average"] >= 0, spec
    # the bandwidth a step meets (between GEMMs) is the model's; the back-to-back one is kept beside it
    assert spec["measured"]["intra"] > 0 and spec["measured"]["intra_alone"] > 0, spec["measured"]
    # and the after-backward regime's (DDP's bucket in place, back to back)
    assert spec["measured"]["bucket"] > 0 and 0 < spec["measured"]["bucket_latency"] < 1, spec["measured"]
    m = tmp_path / "m.json"
    m.write_text('{"step": 1, "loss": 2.0, "tokens_per_s": 10}\n{"step": 2, "loss": 1.5, "tokens_per_s": 11}\n')
    r = _cli("plot", str(m), "-o", str(tmp_path / "m.png"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert r.returncode == 1 and "pip install 'axonmpi[plot]'" in r.stderr and "Traceback" not in r.stderr
    else:
        assert r.returncode == 0 and os.path.getsize(tmp_path / "m.png") > 0
    (tmp_path / "bad.json").write_text("not json\n")
    r = _cli("plot", str(tmp_path / "bad.json"))
    assert r.returncode == 1 and "bad.json:1: not a JSON line" in r.stderr


@pytest.mark.serial
def test_slurm_3d_gpu_binds_one_gpu_per_task_and_checks_the_sizes(slurm_env):
    """The GPU 3-D job: sizes checked against SLURM_NTASKS, `axonmpi info` and the plan first, one GPU per task."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = slurm_env(SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4(x2)", G_INTER="2", G_INTRA_C="2",
                    PLAN_ARGS="--layers 8 --width 512 --seq 128 --global-batch 32")
    job = os.path.join(root, "jobs", "slurm_3d_gpu.sbatch")
    r = subprocess.run(["bash", job, "--steps", "10"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[1] == "srun --gpus-per-task=1 --gpu-bind=closest python -m axonmpi info --ranks", r.stdout
    assert out[2] == ("srun --gpus-per-task=1 --gpu-bind=closest python -m axonmpi plan --world 8 --gpus-per-node 4 "
                      "--measure --layers 8 --width 512 --seq 128 --global-batch 32"), r.stdout
    assert ("--G-data 2 --G-inter 2 --G-intra-r 1 --G-intra-c 2 --G-intra-d 1 --tp-style axonn --schedule 1f1b "
            "--steps 10") in out[3] and out[3].startswith("srun --gpus-per-task=1 --gpu-bind=closest"), r.stdout
    r = subprocess.run(["bash", job], capture_output=True, text=True, timeout=60, env={**env, "G_INTER": "3"})
    assert r.returncode == 2 and "= 6 does not divide SLURM_NTASKS=8" in r.stderr, r.stderr
    r = subprocess.run(["bash", job], capture_output=True, text=True, timeout=60,
                       env={**env, "G_INTER": "1", "G_INTRA_C": "8", "PLAN_ARGS": ""})
    assert r.returncode == 0 and "tensor group (8 ranks) does not divide the 4 tasks per node" in r.stderr, r.stderr


def test_the_datasheet_output_says_what_kernels_its_presets_assume(capsys):
    """A datasheet machine's table ends with the kernels its fitted efficiencies assume (Megatron-LM's, with the
    fitted fractions) and where axonmpi's own GPU speed is; a measured machine's says its rates are measured."""
    from axonmpi.cli import main
    from axonmpi.planner import FITTED
    assert main(SMALL[:-2] + ["--hardware", "dgx-h100", "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("kernels assumed: Megatron-LM's (cuBLAS GEMMs reaching up to "
                              f"{FITTED.gemm_max:.0%} of the datasheet peak") and "docs/gpu.md" in out[-1], out
    assert main(SMALL[:-2] + ["--hardware", "cpu", "--top", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("kernels assumed: the rates measured on cpu")
