"""Hybrid DP x TP x PP through the user-facing path: examples/train_gpt.py under every layout equals one process."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
# float64, 5 AdamW steps with active clipping (norms ~1 vs --grad-clip 0.05), a tiny GPT
TINY = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "8", "--corpus-bytes", "60000",
        "--eval-batches", "1", "--no-progress", "--sample-chars", "0", "--global-batch", "12", "--steps", "5",
        "--dtype", "float64", "--no-save", "--lr", "1e-2", "--grad-clip", "0.05", "--warmup", "2"]

# (G_data, G_inter, G_intra_r, G_intra_c, G_intra_d), extra flags
LAYOUTS = [
    ((2, 2, 1, 1, 1), ["--microbatches", "2"]),
    ((2, 1, 1, 2, 1), ["--tp-style", "megatron"]),
    ((2, 1, 1, 2, 1), ["--tp-style", "axonn"]),
    ((1, 2, 1, 2, 1), ["--tp-style", "megatron", "--schedule", "gpipe", "--microbatches", "3"]),
    ((1, 2, 1, 1, 2), ["--schedule", "interleaved", "--microbatches", "2"]),
    ((1, 1, 2, 1, 2), []),
    ((1, 1, 2, 2, 1), ["--activation-checkpointing"]),
    ((4, 1, 1, 1, 1), []),
    ((3, 1, 1, 1, 1), []),
    ((1, 3, 1, 1, 1), ["--microbatches", "3"]),
    ((1, 1, 1, 3, 1), ["--tp-style", "axonn"]),
    # FullyShardedDataParallel over the data ranks (ZeRO-3, ZeRO-2, hybrid shard, host offload)
    ((4, 1, 1, 1, 1), ["--fsdp", "full_shard"]),
    ((4, 1, 1, 1, 1), ["--fsdp", "shard_grad_op"]),
    ((2, 1, 1, 1, 1), ["--fsdp", "hybrid_shard"]),
    ((4, 1, 1, 1, 1), ["--fsdp", "hybrid_shard", "--hybrid-shard-size", "2"]),     # 2 shards x 2 replicas
    ((3, 1, 1, 1, 1), ["--fsdp", "full_shard", "--cpu-offload"]),
    # FSDP over the data ranks x tensor parallel: FSDP shards each rank's TP-local parameters
    ((2, 1, 1, 2, 1), ["--tp-style", "megatron", "--fsdp", "full_shard"]),
    ((2, 1, 1, 2, 1), ["--tp-style", "megatron", "--fsdp", "shard_grad_op"]),
    ((2, 1, 1, 2, 1), ["--tp-style", "megatron", "--fsdp", "hybrid_shard", "--hybrid-shard-size", "1",
                       "--cpu-offload"]),
    ((2, 1, 1, 2, 1), ["--tp-style", "axonn", "--fsdp", "full_shard"]),
    ((2, 1, 1, 1, 2), ["--tp-style", "axonn", "--fsdp", "shard_grad_op"]),
    # through parallelize: FSDP x pipeline (x tensor + sequence parallel), zero bubble x tensor
    ((2, 2, 1, 1, 1), ["--fsdp", "full_shard", "--microbatches", "2"]),
    ((1, 2, 1, 2, 1), ["--tp-style", "megatron", "--sequence-parallel", "--fsdp", "full_shard", "--microbatches", "2"]),
    ((1, 2, 1, 2, 1), ["--tp-style", "megatron", "--schedule", "zbv", "--microbatches", "2"]),
]


# make test runs the trainer at one layout of each kind (data x pipeline, Megatron TP, AxoNN's 2-D tensor grid,
# FSDP, FSDP x TP, zero bubble x TP); the others are marked slow (make test-all): each layout's arithmetic is
# checked in process, faster, by test_hybrid_gpt_in_process_equals_serial, tests/test_nd_layouts.py and
# tests/test_recipe_layouts.py, and this file checks the trainer's flags reach it
FAST_LAYOUTS = {0, 1, 5, 11, 16, 25}
LAYOUT_PARAMS = [pytest.param(sizes, extra, marks=() if i in FAST_LAYOUTS else pytest.mark.slow)
                 for i, (sizes, extra) in enumerate(LAYOUTS)]


def _run(tmp, name, sizes=None, extra=()):
    from axonmpi.testing import mpiexec_env, run_mpiexec
    metrics, params = str(tmp / f"{name}.jsonl"), str(tmp / f"{name}.npz")
    args = [SCRIPT, *TINY, "--metrics-json", metrics, "--dump-params", params, *extra]
    if sizes is None:
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=mpiexec_env(),
                           cwd=tmp)
    else:
        flags = [f for k, v in zip(("--G-data", "--G-inter", "--G-intra-r", "--G-intra-c", "--G-intra-d"), sizes)
                 for f in (k, str(v))]
        r = run_mpiexec(args + flags, n=int(np.prod(sizes)), timeout=240, cwd=str(tmp))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(ln) for ln in open(metrics)]
    return rows, dict(np.load(params)), r


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serial")
    return _run(tmp, "serial")


@pytest.mark.serial
@pytest.mark.parametrize("sizes,extra", LAYOUT_PARAMS, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple)
                         else "-".join(a.strip("-") for a in v) or "default")
def test_layout_matches_one_process(sizes, extra, serial, tmp_path):
    ref_rows, ref_params, _ = serial
    rows, params, r = _run(tmp_path, "layout", sizes, extra)
    _assert_same_run(rows, params, ref_rows, ref_params)
    assert r.stdout.count("ProcessGrid(") == 1          # rank 0 prints the grid table once


@pytest.mark.serial
def test_tied_head_across_pipeline_stages_matches_one_process(tmp_path):
    """--tie-word-embeddings with a pipeline x Megatron tensor layout: the first and last stages each hold the
    tied weight, its gradient summed between them; losses, clip norms and parameters equal one process."""
    ref_rows, ref_params, _ = _run(tmp_path, "serial_tied", None, ["--tie-word-embeddings"])
    rows, params, _ = _run(tmp_path, "tied", (1, 2, 1, 2, 1), ["--tie-word-embeddings", "--tp-style", "megatron",
                                                               "--microbatches", "2"])
    _assert_same_run(rows, params, ref_rows, ref_params)


def _assert_same_run(rows, params, ref_rows, ref_params):
    """train_gpt's metrics and dumped parameters equal the reference run's (1e-9)."""
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5]
    ref_loss, loss = np.array([x["loss"] for x in ref_rows]), np.array([x["loss"] for x in rows])
    assert np.abs(loss - ref_loss).max() <= 1e-9 * np.abs(ref_loss).max(), (loss, ref_loss)
    ref_norm, norm = np.array([x["grad_norm"] for x in ref_rows]), np.array([x["grad_norm"] for x in rows])
    assert np.all(ref_norm > 0.05)                      # clipping is active
    assert np.abs(norm - ref_norm).max() <= 1e-9 * ref_norm.max(), (norm, ref_norm)
    assert params.keys() == ref_params.keys()
    for k, v in ref_params.items():
        scale = max(np.abs(v).max(), 1e-300)
        assert params[k].shape == v.shape and np.abs(params[k] - v).max() <= 1e-9 * scale, k


def _flags(sizes):
    return [f for k, v in zip(("--G-data", "--G-inter", "--G-intra-r", "--G-intra-c", "--G-intra-d"), sizes)
            for f in (k, str(v))]


def _check_link(metrics, k, last, ref, mgr, total=8):
    """Link ``k`` of a resume chain ran steps ``2k+1..total`` with the uninterrupted run's losses; unless it
    is the ``last``, "interrupt" it after two steps: drop its later checkpoints.  Returns its metric rows."""
    import shutil
    rows = [json.loads(ln) for ln in open(metrics)]
    assert [x["step"] for x in rows] == list(range(2 * k + 1, total + 1)), rows
    for x in rows:
        assert abs(x["loss"] - ref[x["step"]]) <= 1e-9 * abs(ref[x["step"]]), (k, x, ref[x["step"]])
    if not last:
        for s in mgr.steps():
            if s > 2 * (k + 1):
                shutil.rmtree(mgr.path_for(s))
    return rows


@pytest.mark.slow  # covered faster: resharding on load: tests/test_nd_layouts.py, test_sharded_state.py; the trainer's resume under another layout: test_context_parallel.py, test_train_llama_cli.py
@pytest.mark.serial
def test_checkpoint_reshards_across_four_layouts(tmp_path):
    """TP2 x PP2 (Megatron) -> DP4 -> AxoNN (2,1,2) -> serial: each run resumes the last one's checkpoint;
    every step's loss, the final parameters and the optimizer state equal an uninterrupted serial run."""
    from axonmpi import checkpoint as ckpt
    from axonmpi.testing import mpiexec_env, run_mpiexec
    base = [SCRIPT, *[a for a in TINY if a != "--no-save"]]
    base[base.index("--steps") + 1] = "8"
    base += ["--save-every", "2", "--keep-last", "10"]
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    r = subprocess.run([sys.executable, *base, "--checkpoint-dir", ref_dir, "--metrics-json", str(tmp_path / "ref.jsonl")],
                       capture_output=True, text=True, timeout=120, env=mpiexec_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = {x["step"]: x["loss"] for x in map(json.loads, open(tmp_path / "ref.jsonl"))}
    chain = [((1, 2, 1, 2, 1), ["--tp-style", "megatron", "--microbatches", "2"]), ((4, 1, 1, 1, 1), []),
             ((1, 1, 2, 1, 2), ["--tp-style", "axonn"]), (None, [])]
    mgr = ckpt.CheckpointManager(run_dir, keep_last=None)
    got = {}
    for k, (sizes, extra) in enumerate(chain):
        metrics = str(tmp_path / f"run{k}.jsonl")
        args = base + ["--checkpoint-dir", run_dir, "--metrics-json", metrics, *extra] + (["--resume"] if k else [])
        if sizes is None:
            r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                               env=mpiexec_env(), cwd=tmp_path)
        else:
            r = run_mpiexec(args + _flags(sizes), n=int(np.prod(sizes)), timeout=240, cwd=str(tmp_path))
        assert r.returncode == 0, r.stderr[-3000:]
        rows = _check_link(metrics, k, k == len(chain) - 1, ref, mgr)
        got.update({x["step"]: x["loss"] for x in rows[:2]})
        if k < len(chain) - 1:
            saved = ckpt.load(mgr.path_for(2 * (k + 1)))
            want = {"G_data": 1, "G_inter": 1, "G_intra_r": 1, "G_intra_c": 1, "G_intra_d": 1}
            if sizes is not None:
                want = dict(zip(want, sizes))
            assert {kk: saved["extra"]["layout"][kk] for kk in want} == want
    assert sorted(got) == list(range(1, 9))
    import re
    r = subprocess.run([sys.executable, "-m", "axonmpi", "ckpt", "inspect", str(mgr.path_for(2))], capture_output=True,
                       text=True, timeout=60, env=mpiexec_env())
    assert r.returncode == 0 and re.search(r"extra/layout/G_inter\s+int\s+2\n", r.stdout) \
        and re.search(r"extra/layout/G_intra_c\s+int\s+2\n", r.stdout) and "'megatron'" in r.stdout, r.stdout
    a, b = ckpt.load(mgr.path_for(8)), ckpt.load(ckpt.CheckpointManager(ref_dir).path_for(8))
    assert a["model"].keys() == b["model"].keys()
    for name, v in b["model"].items():
        assert np.abs(a["model"][name] - v).max() <= 1e-9 * max(np.abs(v).max(), 1e-300), name
    for name, st in b["optimizer"]["state"].items():
        for key, v in st.items():
            w = a["optimizer"]["state"][name][key]
            assert np.abs(np.asarray(w) - np.asarray(v)).max() <= 1e-9 * max(np.abs(np.asarray(v)).max(), 1e-300), \
                (name, key)


@pytest.mark.serial
@pytest.mark.parametrize("n,flags,needles", [
    # (the vocabulary of 94 is padded to 96 for G_intra_c=3 by the trainer: not a refusal)
    (3, ["--G-intra-c", "3", "--tp-style", "megatron"], ["n_head=2 does not divide by G_intra_c=3"]),
    (2, ["--G-inter", "2", "--G-intra-r", "1", "--n-layer", "1", "--schedule", "interleaved", "--microbatches", "3"],
     ["G_inter=2 x 2 virtual stages needs at least one each", "num_microbatches=3 to be a multiple of G_inter=2"]),
    (2, ["--G-intra-r", "2", "--tp-style", "megatron"], ["--tp-style megatron splits over one dimension"]),
    (2, ["--G-intra-d", "2", "--global-batch", "3"], ["global batch 3 does not divide into 2 equal row slices"]),
    (4, ["--G-inter", "3"], ["G_inter=3", "so G_data cannot be derived"]),
    (2, ["--G-intra-c", "2", "--tp-style", "axonn", "--sequence-parallel", "--tie-word-embeddings"],
     ["sequence_parallel needs tp_style='megatron' (G_intra_c > 1)"]),
    (2, ["--G-inter", "2", "--moe-experts", "2", "--activation-checkpointing"],
     ["auxiliary (router) losses with activation_checkpointing=True in a pipeline are not built"]),
    (2, ["--cpu-offload"], ["--cpu-offload and --mixed-precision fp16 need --fsdp"]),
])
def test_impossible_layouts_are_refused_naming_the_sizes(n, flags, needles, tmp_path):
    from axonmpi.testing import run_mpiexec
    args = [SCRIPT, *TINY]
    r = run_mpiexec(args + flags, n=n, timeout=120, cwd=str(tmp_path))
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    for needle in needles:
        assert r.stderr.count(needle) == 1, (needle, r.stderr[-2000:])
    assert "step 1" not in r.stderr                     # refused before any work


@pytest.mark.slow  # covered faster: FSDP x TP checkpoints across layouts: tests/test_sharded_state.py and test_fsdp_checkpoint.py, in process
@pytest.mark.serial
def test_checkpoint_chain_fsdp_tp_serial_fsdp(tmp_path):
    """FSDP full_shard at 4 ranks -> FSDP x Megatron TP 2 (2,1,1,2,1) -> FSDP x AxoNN depth 2 (2,1,1,1,2) ->
    FSDP x pipeline (2,2,1,1,1) -> serial -> FSDP shard_grad_op at 3: each run resumes the last one's checkpoint
    (pure FSDP saves flattened shards under serial names, FSDP x TP, FSDP x pipeline and serial full-shape
    blocks); every step's loss and the final parameters and AdamW moments equal an uninterrupted serial run."""
    from axonmpi import checkpoint as ckpt
    from axonmpi.testing import mpiexec_env, run_mpiexec
    total = 12
    base = [SCRIPT, *[a for a in TINY if a != "--no-save"]]
    base[base.index("--steps") + 1] = str(total)
    base += ["--save-every", "2", "--keep-last", "10"]
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    r = subprocess.run([sys.executable, *base, "--checkpoint-dir", ref_dir, "--metrics-json", str(tmp_path / "ref.jsonl"),
                        "--dump-params", str(tmp_path / "ref.npz")],
                       capture_output=True, text=True, timeout=120, env=mpiexec_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = {x["step"]: x["loss"] for x in map(json.loads, open(tmp_path / "ref.jsonl"))}
    chain = [((4, 1, 1, 1, 1), ["--fsdp", "full_shard"]),
             ((2, 1, 1, 2, 1), ["--tp-style", "megatron", "--fsdp", "full_shard"]),
             ((2, 1, 1, 1, 2), ["--tp-style", "axonn", "--fsdp", "full_shard"]),
             ((2, 2, 1, 1, 1), ["--fsdp", "full_shard"]), (None, []),
             ((3, 1, 1, 1, 1), ["--fsdp", "shard_grad_op"])]
    mgr = ckpt.CheckpointManager(run_dir, keep_last=None)
    for k, (sizes, extra) in enumerate(chain):
        metrics = str(tmp_path / f"run{k}.jsonl")
        args = base + ["--checkpoint-dir", run_dir, "--metrics-json", metrics, *extra] + (["--resume"] if k else [])
        if k == len(chain) - 1:
            args += ["--dump-params", str(tmp_path / "run.npz")]
        if sizes is None:
            r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                               env=mpiexec_env(), cwd=tmp_path)
        else:
            r = run_mpiexec(args + _flags(sizes), n=int(np.prod(sizes)), timeout=240, cwd=str(tmp_path))
        assert r.returncode == 0, r.stderr[-3000:]
        _check_link(metrics, k, k == len(chain) - 1, ref, mgr, total)
        if k < len(chain) - 1:
            saved = ckpt.load(mgr.path_for(2 * (k + 1)))
            layout = saved["extra"]["layout"]
            assert layout["fsdp"] == (extra[extra.index("--fsdp") + 1] if "--fsdp" in extra else "none")
            if sizes is not None:
                assert [layout[kk] for kk in ("G_data", "G_inter", "G_intra_r", "G_intra_c", "G_intra_d")] == \
                    list(sizes)
            if k == 1:      # FSDP x TP saves full-shape entries (TP blocks), loadable by any layout
                assert layout["tp_style"] == "megatron"
                assert saved["model"]["blocks.0.attn.qkv.weight"].shape == (48, 16)
    a, b = ckpt.load(mgr.path_for(total)), ckpt.load(ckpt.CheckpointManager(ref_dir).path_for(total))
    assert a["model"].keys() == b["model"].keys()
    for name, v in b["model"].items():              # FSDP's flattened entries come back in their own shape
        assert a["model"][name].shape == v.shape
        assert np.abs(a["model"][name].reshape(v.shape) - v).max() <= 1e-9 * max(np.abs(v).max(), 1e-300), name
    for name, st in b["optimizer"]["state"].items():
        for key, v in st.items():
            w, v = np.asarray(a["optimizer"]["state"][name][key]), np.asarray(v)
            assert np.abs(w.reshape(v.shape) - v).max() <= 1e-9 * max(np.abs(v).max(), 1e-300), (name, key)
    got, want = np.load(tmp_path / "run.npz"), np.load(tmp_path / "ref.npz")
    assert sorted(got.keys()) == sorted(want.keys())
    for name in want:                               # --dump-params: full serial-named arrays under FSDP
        assert got[name].shape == want[name].shape
        assert np.abs(got[name] - want[name]).max() <= 1e-9 * max(np.abs(want[name]).max(), 1e-300), name


@pytest.mark.serial
@pytest.mark.parametrize("n,layout", [(2, []), pytest.param(4, ["--G-inter", "2", "--microbatches", "2"],
                                                              marks=pytest.mark.slow)],
                         ids=["fsdp2", "fsdp2_pp2"])
def test_fsdp_fp16_mixed_precision_trains(tmp_path, n, layout):
    """--fsdp full_shard --mixed-precision fp16 (float16 compute, float32 reduction, loss scaling) learns:
    its loss follows the float32 run's within float16 rounding; with a pipeline too (its FSDP stages gathered in
    float16, each micro-batch's loss scaled)."""
    from axonmpi.testing import run_mpiexec
    base = [SCRIPT, *TINY, "--fsdp", "full_shard", *layout]
    base[base.index("--dtype") + 1] = "float32"
    base[base.index("--steps") + 1] = "12"
    base[base.index("--grad-clip") + 1] = "1.0"
    out = {}
    for name, extra in (("fp32", []), ("fp16", ["--mixed-precision", "fp16"])):
        metrics = str(tmp_path / f"{name}.jsonl")
        r = run_mpiexec(base + extra + ["--metrics-json", metrics], n=n, timeout=240, cwd=str(tmp_path))
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = np.array([json.loads(ln)["loss"] for ln in open(metrics)])
    assert np.all(np.isfinite(out["fp16"])) and out["fp16"][-1] < out["fp16"][0] - 0.3, out["fp16"]
    assert np.abs(out["fp16"] - out["fp32"]).max() < 0.05, (out["fp16"], out["fp32"])


@pytest.mark.serial
@pytest.mark.parametrize("fsdp", ["none", pytest.param("full_shard", marks=pytest.mark.slow)])
def test_bf16_mixed_precision_trains_like_float32(tmp_path, fsdp):
    """Issue 21: --mixed-precision bf16 (bfloat16 compute, float32 reduction and master weights) with DDP
    (--fsdp none: FSDP no_shard) and FSDP trains 20 steps with every loss within 2e-2 of float32's."""
    pytest.importorskip("ml_dtypes")
    from axonmpi.testing import run_mpiexec
    base = [SCRIPT, *TINY, "--fsdp", fsdp]
    base[base.index("--dtype") + 1] = "float32"
    base[base.index("--steps") + 1] = "20"
    base[base.index("--grad-clip") + 1] = "1.0"
    out = {}
    for name, extra in (("fp32", []), ("bf16", ["--mixed-precision", "bf16"])):
        metrics = str(tmp_path / f"{name}.jsonl")
        r = run_mpiexec(base + extra + ["--metrics-json", metrics], n=2, timeout=240, cwd=str(tmp_path))
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = np.array([json.loads(ln)["loss"] for ln in open(metrics)])
    assert len(out["bf16"]) == 20 and np.all(np.isfinite(out["bf16"]))
    assert out["bf16"][-1] < out["bf16"][0] - 0.3, out["bf16"]
    assert np.abs(out["bf16"] - out["fp32"]).max() < 2e-2, (out["bf16"], out["fp32"])


@pytest.mark.slow  # covered faster: the scaler's state across a resume: tests/test_amp.py::test_grad_scaler_state_dict_resumes_the_same_schedule
@pytest.mark.serial
def test_fp16_resume_continues_with_the_saved_loss_scale(tmp_path):
    """--mixed-precision fp16 checkpoints hold the GradScaler's state (scale, growth tracker): a run resumed
    at step 4 continues with the uninterrupted run's loss scale and losses, overflow skips included (a fresh
    scaler would restart at --init-loss-scale and skip other steps)."""
    import shutil
    from axonmpi import checkpoint as ckpt
    from axonmpi.testing import run_mpiexec
    base = [SCRIPT, *[a for a in TINY if a != "--no-save"], "--fsdp", "full_shard", "--mixed-precision", "fp16",
            "--init-loss-scale", "1e6", "--loss-scale-growth-interval", "2", "--save-every", "4", "--keep-last", "10"]
    for opt, v in (("--dtype", "float32"), ("--steps", "8"), ("--grad-clip", "1.0")):
        base[base.index(opt) + 1] = v
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    r = run_mpiexec(base + ["--checkpoint-dir", whole, "--metrics-json", str(tmp_path / "whole.jsonl")], n=2,
                    timeout=240, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    ref = [json.loads(ln) for ln in open(tmp_path / "whole.jsonl")]
    scales = [x["loss_scale"] for x in ref]
    assert scales[0] < 1e6 and len(set(scales)) >= 3, scales        # backoffs and growth both happened
    saved = ckpt.load(ckpt.CheckpointManager(whole).path_for(4))["extra"]["scaler"]
    assert saved["scale"] == scales[3] and saved["_growth_tracker"] >= 1, (saved, scales)
    shutil.copytree(whole, part)
    shutil.rmtree(ckpt.CheckpointManager(part).path_for(8))
    r = run_mpiexec(base + ["--checkpoint-dir", part, "--metrics-json", str(tmp_path / "part.jsonl"), "--resume"],
                    n=2, timeout=240, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"loss scale {scales[3]:g} (growth tracker {saved['_growth_tracker']}) restored" in r.stderr
    got = [json.loads(ln) for ln in open(tmp_path / "part.jsonl")]
    assert [x["step"] for x in got] == [5, 6, 7, 8]
    assert [x["loss_scale"] for x in got] == scales[4:]
    np.testing.assert_allclose([x["loss"] for x in got], [x["loss"] for x in ref[4:]], rtol=1e-6)


# -- in process, on the pass's ranks: HybridGPT against the serial GPT --------------------------------------
IN_PROCESS = {2: [((1, 2, 1, 1, 1), "axonn", "gpipe"), ((1, 1, 1, 2, 1), "megatron", "1f1b"),
                  ((1, 2, 1, 1, 1), "axonn", "zbv"), ((1, 2, 1, 1, 1), "axonn", "zb-h1"),
                  ((1, 1, 1, 2, 1), "megatron", "1f1b", "full_shard")],
              3: [((1, 1, 3, 1, 1), "axonn", "1f1b")],
              4: [((1, 2, 2, 1, 1), "axonn", "1f1b"), ((2, 2, 1, 1, 1), "megatron", "interleaved"),
                  ((1, 2, 1, 2, 1), "megatron", "zbv"), ((2, 2, 1, 1, 1), "axonn", "zb-h1"),
                  ((2, 1, 1, 2, 1), "megatron", "1f1b", "shard_grad_op"), ((2, 1, 2, 1, 1), "axonn", "1f1b", "full_shard")]}


@pytest.mark.mpi(min_size=2)
def test_hybrid_gpt_in_process_equals_serial():
    import axonmpi
    from axonmpi.models import GPT, GPTConfig
    from axonmpi.optim import AdamW, clip_grad_norm_
    from axonmpi.recipes import HybridGPT
    world = axonmpi.init()
    cfg = GPTConfig(vocab_size=12, block_size=6, n_layer=2, n_head=2, n_embd=8)
    rng = np.random.default_rng(3)
    batches = [(rng.integers(0, 12, (12, 6)), rng.integers(0, 12, (12, 6))) for _ in range(4)]
    axonmpi.manual_seed(7)
    ref = GPT(cfg, dtype="float64")
    opt = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses = []
    for x, y in batches:
        opt.zero_grad()
        _, loss = ref(x, y)
        loss.backward()
        clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        ref_losses.append(float(loss.item()))
    want = ref.state_dict()
    for sizes, style, sched, *fsdp in IN_PROCESS.get(world.world_size, []):
        grid = axonmpi.ProcessGrid(world, **dict(zip(("G_data", "G_inter", "G_intra_r", "G_intra_c", "G_intra_d"),
                                                     sizes)))
        axonmpi.manual_seed(7)
        hyb = HybridGPT(cfg, grid, tp_style=style, schedule=sched, num_microbatches=2, dtype="float64",
                        global_batch=12, fsdp=fsdp[0] if fsdp else None)
        opt = AdamW(hyb.parameters(), lr=1e-2, weight_decay=0.1)
        losses = []
        for x, y in batches:
            opt.zero_grad()
            losses.append(hyb.forward_backward(hyb.local_batch(x), hyb.local_batch(y)))
            hyb.clip_grad_norm_(0.05)
            opt.step()
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0, err_msg=str(sizes))
        got = hyb.full_state_dict()
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-10, atol=1e-13, err_msg=f"{sizes} {k}")
        # dropout streams: shared by the ranks holding the same rows, distinct across row slices
        seeds = axonmpi.all_gather_object((hyb.shard_index, hyb.dropout_seed(5)))
        assert len({s for _, s in seeds}) == len({i for i, _ in seeds}) == hyb.shards
        grid.free()


@pytest.mark.mpi(min_size=2)
def test_pipeline_data_replicas_draw_their_own_dropout_masks():
    """On main the pipeline's dropout seed ignored the data-parallel rank: replicas fed the same
    samples drew identical masks.  Now replica r > 0 has its own stream (replica 0 keeps the old one)."""
    import axonmpi
    import axonmpi.nn as nn
    from axonmpi.parallel.pipeline import Pipeline
    world = axonmpi.init()
    pp = world.split(world.rank, name="own-pipeline")           # one stage per rank; data group: everyone
    axonmpi.manual_seed(3)
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 2, dtype="float64"))
    seen = []

    def loss_fn(out, y):
        seen.append(np.array(out.data, copy=True))
        return ((out - y) * (out - y)).mean()

    pipe = Pipeline([model], "gpipe", num_microbatches=1, loss_fn=loss_fn, group=pp,
                    data_group=world.default_group)
    x = np.ones((8, 4))
    pipe.step(x, np.zeros((8, 2)))
    outs = axonmpi.all_gather_object(seen[0])
    assert not np.array_equal(outs[0], outs[1])                  # replicas 0 and 1: different masks


@pytest.mark.mpi(min_size=2)
def test_hybrid_gpt_fsdp_with_pipeline_or_checkpointing_is_built_by_the_composer():
    """HybridGPT(fsdp=...) with a pipeline or activation checkpointing is laid out by ``parallelize`` (its
    stages' flat shards; parity in tests/test_recipe_layouts.py); offload / mixed precision without a sharding
    strategy are refused, naming the values."""
    import axonmpi
    from axonmpi.models import GPTConfig
    from axonmpi.recipes import HybridGPT
    world = axonmpi.init()
    cfg = GPTConfig(vocab_size=12, block_size=6, n_layer=2, n_head=2, n_embd=8)
    half = world.world_size // 2
    cases = [({"G_data": world.world_size}, {"activation_checkpointing": True})]
    if world.world_size % 2 == 0:
        cases += [({"G_inter": 2, "G_data": half}, {}),
                  ({"G_intra_c": 2, "G_data": half}, {"tp_style": "megatron", "activation_checkpointing": True})]
    for sizes, extra in cases:
        grid = axonmpi.ProcessGrid(world, **sizes)
        hyb = HybridGPT(cfg, grid, fsdp="full_shard", global_batch=12, **extra)
        assert hyb.pm is not None and "FSDP" in hyb.describe() or hyb.pipe is not None
        grid.free()
    with pytest.raises(ValueError, match="cpu_offload='full'.*need fsdp"):
        HybridGPT(cfg, fsdp="none", cpu_offload="full", global_batch=12)


@pytest.mark.mpi(min_size=2)
def test_pipeline_ranks_build_only_their_layers():
    """With G_inter > 1 each rank builds only its stage's layers: the other layers' parameters are zero-stride
    stand-ins (their full shapes, no memory), the arrays held are exactly the rank's trained parameters, and
    their values equal the serial GPT's init (the random stream replayed layer by layer); Megatron TP too."""
    import axonmpi
    from axonmpi.models import GPT, GPTConfig
    from axonmpi.recipes import HybridGPT
    world = axonmpi.init()
    n = world.world_size
    cfg = GPTConfig(vocab_size=16, block_size=6, n_layer=2 * n, n_head=2, n_embd=8)
    axonmpi.manual_seed(11)
    want = GPT(cfg, dtype="float64").state_dict()
    full_bytes = sum(v.nbytes for v in want.values())
    cases = [({"G_inter": n}, "axonn", "1f1b")]
    if n % 2 == 0:
        cases.append(({"G_inter": n // 2, "G_intra_c": 2}, "megatron", "interleaved"))
    for sizes, style, sched in cases:
        grid = axonmpi.ProcessGrid(world, **sizes)
        axonmpi.manual_seed(11)
        hyb = HybridGPT(cfg, grid, tp_style=style, schedule=sched, num_microbatches=2, dtype="float64",
                        global_batch=4)
        named = dict(hyb.model.named_parameters())
        assert named.keys() == want.keys()
        held = [p for p in named.values() if p.data.size and all(s != 0 for s in p.data.strides)]
        assert {id(p) for p in held} == {id(p) for p in hyb.parameters()}, sizes
        assert sum(p.data.nbytes for p in held) < 0.75 * full_bytes or grid.G_inter == 1   # not the whole GPT
        full = hyb.full_state_dict()          # gathered over tensor and pipeline groups
        for k, v in want.items():
            assert full[k].shape == v.shape and np.array_equal(full[k], v), (sizes, k)
        for k in set(named) - set(hyb.param_names):
            assert hyb.full_shape(k) == want[k].shape
        grid.free()
