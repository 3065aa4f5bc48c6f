"""The planner's cost model (axonmpi/plan.py) against hand-computed cases, and the plan/plot commands."""
import json
import os
import subprocess
import sys

import pytest

from axonmpi.plan import Hardware, Layout, Model, candidate_layouts, estimate, linear_volumes, plan

# 2 blocks, width 4, sequence 2, batch 4, vocabulary 8: Linears (4,12) (4,4) (4,16) (16,4): 192 weights,
# 36 biases and two LayerNorms (16) = 244 a block; 2*244 + (8+2)*4 embeddings + 8 ln_f + 8*4 head = 568 in all
M = Model(layers=2, width=4, seq=2, global_batch=4, vocab=8, dtype_bytes=4)
HW = Hardware(bw_intra=1e3, bw_inter=1e2, flops=1e3, gpus_per_node=4)
ZERO = {"col": 0.0, "row": 0.0, "depth": 0.0, "inter": 0.0, "data": 0.0, "repl": 0.0}


@pytest.mark.serial
def test_linear_volumes_are_the_easy_mode_closed_forms():
    # n=4 rows, in=8, out=16 on G_r = G_c = G_d = 2
    v = linear_volumes(8, 16, 4, 2, 2, 2)
    assert v["col"] == {"allreduce": 2 * 4 * 16, "gather": 2 * 4 * 8 + 2 * 4 * 16}     # AR out; a2a in x2, AG out
    assert v["row"] == {"allreduce": 2 * 4 * 8, "gather": 2 * 4 * 8 + 2 * 2 * 4 * 16}  # AR dX; AG in, a2a out x2
    assert v["depth"] == {"gather": 2 * 8 * 16 / 4}                                    # weight AG + dW RS
    assert linear_volumes(8, 16, 4, 1, 1, 1) == {"col": {}, "row": {}, "depth": {}}
    assert linear_volumes(8, 16, 4, 1, 1, 2) == {"col": {}, "row": {}, "depth": {"gather": 256.0}}   # no easy mode
    assert M.block_params == 244 and M.params == 568


@pytest.mark.serial
def test_row_split_by_hand():
    e = estimate(M, Layout(G_intra_r=2), HW)
    # n = 4/2 rows x 2 = 4 tokens a rank; per Linear 2 G_r n in + 2 n out = 16 in + 8 out: blocks 2*(16*28 + 8*36),
    # head (4, 8): 64 + 64; the replicated LayerNorms and embeddings (80) over all ranks
    assert e.volumes == {**ZERO, "row": 2 * (16 * 28 + 8 * 36) + 128.0, "repl": 80.0}
    # all-reduce part G_r n in = 8 in: 2*8*28 + 32 = 480 at 2 (p-1)/p = 1; the rest at (p-1)/p = 1/2
    assert e.comm_times["row"] == pytest.approx((480 + 0.5 * (1600 - 480)) * 4 / 1e3)
    assert e.comm_times["repl"] == pytest.approx(80 * 4 / 1e3)
    # 6 n sum(in out) + 12 n S H a block, the head 6 n 32: 2 (4608 + 384) + 768 flops at 1e3 flop/s
    assert e.compute_time == pytest.approx(10752 / 1e3)
    assert e.step_time == pytest.approx(10.752 + 4.16 + 0.32)
    # 4 x local parameters (40 embeddings + 2 x (16 + 96 + 18) + 8 + 16) x 4 bytes + activations 34 n H L b
    assert e.memory_bytes == pytest.approx(4 * 324 * 4 + 34 * 4 * 4 * 2 * 4)


@pytest.mark.serial
def test_depth_data_fsdp_and_pipeline_by_hand():
    e = estimate(M, Layout(G_intra_d=2), HW)
    assert e.volumes["depth"] == 2 * 2 * 192 + 2 * 32 + 2 * 36     # weights gathered + scattered, bias all-reduce
    assert e.comm_times["depth"] == pytest.approx((0.5 * 832 + 72) * 4 / 1e3)
    e = estimate(M, Layout(G_intra_d=2), HW, microbatches=3)
    assert e.volumes["depth"] == 3 * 832 + 72                      # the weight again every micro-batch
    e = estimate(M, Layout(G_data=2), HW)
    assert e.volumes == {**ZERO, "data": 568.0}                    # DDP: the whole gradient
    assert e.comm_times["data"] == pytest.approx(568 * 4 / 1e3)
    e = estimate(M, Layout(G_data=2), HW, fsdp="full_shard")
    assert e.volumes["data"] == 3 * 568 and e.comm_times["data"] == pytest.approx(0.5 * 1704 * 4 / 1e3)
    e = estimate(M, Layout(G_inter=2), HW, microbatches=2)
    # cut [embedding 40, block 244 | block 244, head 40]; each stage sends and receives n H = 8*4 once each way
    assert e.volumes == {**ZERO, "inter": 2 * 8 * 4.0}
    # the slower stage: block 6*8*192 + 12*8*2*4 = 9984 plus the head 6*8*32, bubble (2 + 2 - 1) / 2
    assert e.compute_time == pytest.approx((9984 + 1536) / 1e3 * 1.5)
    with pytest.raises(NotImplementedError, match="hybrid_shard"):
        estimate(M, Layout(G_data=2), HW, fsdp="hybrid_shard")
    # FSDP over data x AxoNN columns: TP-local parameters (embeddings 40, blocks 16 + 24+12 + 8+4 + 32+16 + 32+4,
    # ln_f 8 + head 32/2) = 360 gathered twice and reduce-scattered over data; the replicated ones reduced over
    # the tensor block on each rank's data shard: units wte 32 | wpe 8 | block 148 (ln_1 at 0, ln_2 at 56, both
    # in chunk 0 = [0, 74)) x 2 | ln_f 8 | head 16 (split): rank 0 16 + 4 + 2 x 16 + 4 = 56, rank 1 16 + 4 + 4 = 24
    tp, e = estimate(M, Layout(G_data=2, G_intra_c=2), HW), estimate(M, Layout(G_data=2, G_intra_c=2), HW, fsdp="full_shard")
    assert e.volumes == {**tp.volumes, "data": 3 * 360.0, "repl": 56.0}
    assert estimate(M, Layout(G_data=2, G_intra_c=2), HW, fsdp="shard_grad_op").volumes["data"] == 2 * 360.0
    with pytest.raises(ValueError, match="pipeline"):
        estimate(M, Layout(G_data=2, G_inter=2), HW, fsdp="full_shard")


@pytest.mark.serial
def test_placement_latency_and_shared_cores():
    m16 = Model(layers=2, width=4, seq=2, global_batch=16, vocab=8)
    # grid order col, row, depth, inter, data: 4 columns fill a node of 4, the data pairs span two nodes
    e = estimate(m16, Layout(G_data=2, G_intra_c=4), HW)
    assert e.volumes["data"] == 2 * (192 / 4 + 36) + 32 / 4         # 3-D weight shards and biases
    assert e.comm_times["data"] == pytest.approx(1.0 * e.volumes["data"] * 4 / 1e2)
    assert e.comm_times["col"] > 0 and e.comm_times["col"] < e.comm_times["data"] * 100
    lat = estimate(m16, Layout(G_intra_c=2, G_data=2), Hardware(**{**HW.__dict__, "latency": 1.0}))
    base = estimate(m16, Layout(G_intra_c=2, G_data=2), HW)
    # 5 calls on col per split Linear (9 of them), one per gradient tensor on data (8 weights + 8 biases +
    # the head's weight), one per replicated tensor over all ranks (2 + 2*4 + 2)
    assert lat.comm_times["col"] - base.comm_times["col"] == pytest.approx(45)
    assert lat.comm_times["data"] - base.comm_times["data"] == pytest.approx(17)
    assert lat.comm_times["repl"] - base.comm_times["repl"] == pytest.approx(12)
    shared = estimate(m16, Layout(G_data=4), Hardware(**{**HW.__dict__, "cores": 2}))
    assert shared.compute_time == pytest.approx(2 * estimate(m16, Layout(G_data=4), HW).compute_time)


@pytest.mark.serial
def test_the_other_kernels_by_hand():
    """The CPU costs besides the GEMMs: per token and block 4H GELU, 2H LayerNorm, a S scores, 2H adds; the
    final LayerNorm; AdamW over the updated parameters and two copies of every all-reduced gradient."""
    kern = dict(attn_flops=100.0, gelu=1.0, layernorm=2.0, softmax=3.0, add=5.0, adam=7.0, copy=11.0)
    hw = Hardware(**{**HW.__dict__, **kern, "cores": 1.0, "mem_cores": 0.5})
    e = estimate(M, Layout(G_data=2), hw)          # n = 4 tokens a rank, one head, 2 ranks on the node
    gemm = 6 * 4 * (2 * 192 + 4 * 8) / 1e3          # the Linears (the head's included)
    attn = 12 * 4 * 2 * 4 * 2 / 100.0               # 12 n S H a block
    other = 4 * (2 * (16 * 1.0 + 8 * 2.0 + 2 * 3.0) + 4 * 2.0)
    memory = 2 * 4 * 4 * 2 * 5.0 + 568 * 7.0 + 2 * 568 * 11.0
    assert e.compute_time == pytest.approx((gemm + attn + other) * 2 + memory * 4)   # ranks / cores, / mem_cores
    f = estimate(M, Layout(G_data=2), hw, fsdp="full_shard")       # AdamW on the shard; no flat all-reduce
    assert f.compute_time == pytest.approx((gemm + attn + other) * 2 + (2 * 4 * 4 * 2 * 5.0 + 284 * 7.0) * 4)
    assert Hardware.from_measured({"intra": 1.0, "flops": 2.0, "cores": 2.0, **kern}, 4) == Hardware(
        bw_intra=1.0, bw_inter=1.0, flops=2.0, gpus_per_node=4, cores=2.0, **kern)


@pytest.mark.serial
def test_candidates_follow_the_rules_and_plan_is_sorted():
    got = list(candidate_layouts(M, 4))
    for lay in got:
        assert lay.world_size == 4 and M.global_batch % (lay.G_data * lay.tensor_size) == 0
    assert Layout(G_inter=4) in got and Layout(G_data=4) in got
    assert len(got) == 15                                          # every 5-tuple of product 4 runs this GPT
    small = set(candidate_layouts(Model(layers=2, width=4, seq=2, global_batch=2, vocab=8), 4))
    assert Layout(G_data=2, G_intra_r=2) not in small and Layout(G_data=2, G_inter=2) in small   # 4 row slices of 2
    assert Layout(G_intra_c=3) not in set(candidate_layouts(M, 3))   # in = 4 does not divide by 3
    est = plan(M, 4, HW)
    assert [e.step_time for e in est] == sorted(e.step_time for e in est) and len(est) == len(got)
    assert len(plan(M, 4, HW, memory_limit=0)) == 0


def _cli(*args, **kw):
    from axonmpi.testing import mpiexec_env
    return subprocess.run([sys.executable, "-m", "axonmpi", *args], capture_output=True, text=True, timeout=60,
                          env=mpiexec_env(), **kw)


@pytest.mark.serial
def test_plan_and_plot_commands(tmp_path):
    r = _cli("plan", "--world", "4", "--layers", "8", "--width", "512", "--seq", "128", "--global-batch", "32",
             "--top", "3")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "step ms" in lines[1] and len(lines) == 5 and lines[2].split()[0] == "1"
    from axonmpi.testing import run_mpiexec
    saved = tmp_path / "cpu.json"
    r = run_mpiexec(["-m", "axonmpi", "plan", "--world", "2", "--layers", "2", "--width", "64", "--seq", "8",
                     "--global-batch", "4", "--heads", "2", "--hardware", "cpu", "--measure", "--save-hardware",
                     str(saved)], n=2, timeout=60)
    assert r.returncode == 0 and r.stdout.count("(measured)") == 1, r.stderr
    from axonmpi.planner.cpu import hardware_from_spec          # the kernels measured, saved and read back
    hw = hardware_from_spec(str(saved))
    assert all(getattr(hw, k) > 0 for k in ("gelu", "layernorm", "softmax", "add", "adam", "copy", "attn_flops"))
    assert 0 < hw.mem_cores <= (os.cpu_count() or 1)
    spec = json.loads(saved.read_text())        # the run's ranks per node, not the default 8
    assert spec["gpus_per_node"] == 2 and hw.gpus_per_node == 2, spec["gpus_per_node"]
    # the bandwidth a step meets (between GEMMs) is the model's; the back-to-back one is kept beside it
    assert spec["measured"]["intra"] > 0 and spec["measured"]["intra_alone"] > 0, spec["measured"]
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
