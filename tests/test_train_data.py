"""``examples/train_gpt.py`` on token files and under pasted layouts: nanoGPT's ``.bin`` read through a memory map
(``axonmpi.data.TokenFileDataset``), ``examples/prepare_data.py`` (bytes; a byte-level BPE built locally with
``tokenizers``), a run that resumes at the exact sample, a resubmission with more steps that continues in the same
folder, every ``--layout`` string ``axonmpi plan`` prints parsed into the trainer's flags, flags that do nothing
refused, and a pasted layout with ZeRO-1 and sequence parallelism at 4 ranks equal to one process."""
import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
PREPARE = os.path.join(ROOT, "examples", "prepare_data.py")
sys.path.insert(0, os.path.join(ROOT, "examples"))
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "8", "--eval-batches", "1",
        "--no-progress", "--sample-chars", "0", "--global-batch", "4", "--dtype", "float64", "--warmup", "1",
        "--log-every", "1"]


def _text(tmp_path, n=6000):
    import sysconfig
    src = open(os.path.join(sysconfig.get_paths()["stdlib"], "argparse.py"), encoding="utf-8").read()[:n]
    p = tmp_path / "in.txt"
    p.write_text(src, encoding="utf-8")
    return str(p)


def _run(args, cwd, n=1):
    from axonmpi.testing import mpiexec_env, run_mpiexec
    if n == 1:
        r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=240,
                           env=mpiexec_env(), cwd=cwd)
    else:
        r = run_mpiexec([SCRIPT, *args], n=n, timeout=300, cwd=str(cwd))
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-1000:]
    return r


def _rows(path):
    return [json.loads(x) for x in open(path)]


def test_token_file_dataset_reads_nanogpts_layout(tmp_path):
    from axonmpi.data import TokenFileDataset, read_token_meta, write_token_file
    ids = np.arange(70000) % 65536
    path = str(tmp_path / "train.bin")
    assert write_token_file(path, ids, "uint16") == 70000 and os.path.getsize(path) == 140000
    np.testing.assert_array_equal(np.fromfile(path, dtype="<u2"), ids)      # header-free little-endian
    ds = TokenFileDataset(path, 8)
    assert len(ds) == (70000 - 1 - 8) // 8 + 1 and isinstance(ds.tokens, np.memmap)
    x, y = ds.get_batch(np.array([0, 3]))
    np.testing.assert_array_equal(x[1], ids[24:32])
    np.testing.assert_array_equal(y[1], ids[25:33])
    assert x.dtype == np.int64 and ds[3][0].tolist() == ids[24:32].tolist()
    assert len(TokenFileDataset(path, 8, stride=1)) == 70000 - 8
    assert read_token_meta(path) == {}
    (tmp_path / "meta.json").write_text('{"dtype": "uint32"}')
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "x.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        TokenFileDataset(str(tmp_path / "odd" / "x.bin"), 1)
    with pytest.raises(ValueError, match="meta.json beside it says 'uint32'"):
        TokenFileDataset(path, 8, dtype="uint16")
    with pytest.raises(ValueError, match="do not fit uint16; use uint32"):
        write_token_file(path, [70000], "uint16")


def test_prepare_data_bytes_and_a_bpe_built_here(tmp_path):
    import prepare_data
    src = _text(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()):
        meta = prepare_data.main([src, "--out", str(tmp_path / "b")])
    raw = open(src, "rb").read()
    back = np.concatenate([np.fromfile(tmp_path / "b" / f, dtype="<u2") for f in ("train.bin", "val.bin")])
    assert meta["vocab_size"] == 256 and meta["tokenizer"] == "bytes" and bytes(back.astype(np.uint8)) == raw
    assert meta["val_tokens"] == round(0.1 * len(raw))
    pytest.importorskip("tokenizers")
    with contextlib.redirect_stdout(io.StringIO()):
        meta = prepare_data.main([src, src, "--out", str(tmp_path / "t"), "--train-bpe", "300"])
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tmp_path / "t" / meta["tokenizer_path"]))
    ids = np.concatenate([np.fromfile(tmp_path / "t" / f, dtype="<u2") for f in ("train.bin", "val.bin")])
    assert meta["vocab_size"] == 300 and ids.max() < 300 and (ids == meta["eos_id"]).sum() == 1   # 2 documents
    assert tok.decode(ids[:40].tolist()) == raw.decode()[:len(tok.decode(ids[:40].tolist()))]


@pytest.mark.serial
def test_token_data_resumes_at_the_exact_sample_and_more_steps_continue_the_folder(tmp_path):
    """6 steps straight; the same run saving at step 3, its step-6 checkpoint removed (a kill after step 3),
    resubmitted with --auto-resume: steps 4-6 and the weights equal, the sampler's position in the checkpoint is
    step x global batch, the run folder holds the log and the metrics; resubmitted again with --steps 12 it
    continues in the same folder (steps 7-12, the schedule extended)."""
    import shutil

    import prepare_data
    from axonmpi import checkpoint as ckpt
    with contextlib.redirect_stdout(io.StringIO()):
        prepare_data.main([_text(tmp_path), "--out", str(tmp_path / "data")])
    base = [*TINY, "--data", str(tmp_path / "data")]
    _run([*base, "--steps", "6", "--no-save", "--metrics-json", "ref.jsonl", "--dump-params", "ref.npz"], tmp_path)
    ck = str(tmp_path / "run")
    r = _run([*base, "--steps", "6", "--checkpoint-dir", ck, "--auto-resume", "--save-every", "3"], tmp_path)
    assert "tokens (uint16, bytes)" in r.stderr
    mgr = ckpt.CheckpointManager(ck)
    assert mgr.steps() == [3, 6] and ckpt.load(mgr.path_for(3))["sampler"]["consumed_global"] == 3 * 4
    shutil.rmtree(mgr.path_for(6))
    _run([*base, "--steps", "6", "--checkpoint-dir", ck, "--auto-resume", "--dump-params", "res.npz"], tmp_path)
    ref, rows = _rows(tmp_path / "ref.jsonl"), _rows(os.path.join(ck, "metrics.jsonl"))
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(ref, rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-12) and a["sample"] == b["sample"] == 4 * a["step"]
    want, got = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "res.npz")
    for k in want.files:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-14, err_msg=k)
    log = open(os.path.join(ck, "train.log")).read()
    assert "resumed from" in log and "step 6/6 loss" in log and "tokens/s" in log
    assert {"step_s", "tokens_per_s_avg", "host_peak_rss_gib", "epoch", "tokens", "time"} <= set(rows[-1])
    r = _run([*base, "--steps", "12", "--checkpoint-dir", ck, "--auto-resume"], tmp_path)
    assert "LR schedule extended from 6 to 12 steps" in r.stderr
    assert [x["step"] for x in _rows(os.path.join(ck, "metrics.jsonl"))] == list(range(1, 13))
    assert ckpt.CheckpointManager(ck).latest_step() == 12


def _planner_labels():
    from axonmpi.planner import TrainConfig, TransformerConfig
    from axonmpi.planner.hardware import load_hardware
    from axonmpi.planner.search import search
    hw = load_hardware("cpu")
    out = set()
    for world in (4, 8):
        for cfg in (TransformerConfig(layers=4, width=64, heads=4, seq=16, vocab=128),
                    TransformerConfig(layers=4, width=64, heads=4, seq=16, vocab=128, gated=True, rotary=True,
                                      bias=False)):
            for e in search(cfg, TrainConfig(16, 1, "fp32", "none", dropout=False), world, hw, max_cp=2):
                out.add(e.layout.label())
    return sorted(out)


def test_every_layout_the_planner_prints_is_taken_by_the_trainer():
    """``axonmpi plan``'s labels (4 and 8 ranks, GPT and Llama shapes) parse into the five sizes and options
    with ``tp`` as Megatron's; the product of the sizes is the planner's world."""
    import train_gpt
    from axonmpi.planner import ParallelLayout
    labels = _planner_labels()
    assert len(labels) > 10 and any("schedule=" in x for x in labels) and any("zero=" in x for x in labels)
    for label in labels:
        lay = ParallelLayout.parse(label)
        a = train_gpt.parse_args(["--layout", label, "--global-batch", "16"])
        sizes = a.G_data * a.G_inter * a.G_intra_r * a.G_intra_c * a.G_intra_d * a.context_parallel
        assert sizes == lay.world, (label, vars(a))
        assert (a.G_data, a.G_inter, a.context_parallel, a.expert_parallel) == (lay.dp, lay.pp, lay.cp, lay.ep)
        if lay.tp > 1:
            assert a.tp_style == "megatron" and a.G_intra_c == lay.tp and a.sequence_parallel == bool(lay.sp)
        if lay.axonn > 1:
            assert a.tp_style == "axonn" and (a.G_intra_r, a.G_intra_c, a.G_intra_d) == (lay.row, lay.col, lay.depth)
        assert a.zero == (lay.zero == 1) and (a.fsdp != "none") == (lay.zero >= 2)
        assert a.schedule == (lay.pipeline_schedule if lay.pp > 1 else "1f1b")
        assert a.microbatches == (16 // (lay.dp * lay.axonn) if lay.pp > 1 else 1)


@pytest.mark.parametrize("argv,said", [
    (["--schedule", "zbv"], "--schedule zbv does nothing without a pipeline"),
    (["--microbatches", "2"], "--microbatches 2 does nothing without a pipeline"),
    (["--cp-algo", "ulysses"], "--cp-algo ulysses does nothing without --context-parallel"),
    (["--layout", "tp=2,pp=1,dp=2", "--G-inter", "2"], "gives the whole layout: leave out --G-inter"),
    (["--layout", "tp=2,pp=2,dp=1,overlap=0"], "planner's models of other runtimes"),
    (["--G-inter", "2", "--virtual-stages", "3"], "--virtual-stages 3 does nothing with --schedule 1f1b"),
    (["--layout", "tp=2,pp=2,dp=bad"], "dp='bad' is not a whole number"),
    (["--tp", "2", "--G-intra-c", "2"], "--tp 2 is --G-intra-c 2 --tp-style megatron"),
    (["--zero", "1", "--fsdp", "full_shard"], "FSDP already shards the optimizer state"),
    (["--init-from", "gpt2"], "expected hf:DIR"),
])
def test_flags_that_do_nothing_are_refused(argv, said):
    import train_gpt
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        train_gpt.parse_args(argv)
    assert e.value.code == 2 and said in err.getvalue(), err.getvalue()


def test_tp_is_megatron_in_both_helps():
    import train_gpt
    from axonmpi import cli
    a = train_gpt.parse_args(["--tp", "2"])
    assert (a.G_intra_c, a.tp_style) == (2, "megatron")
    text = io.StringIO()
    with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
        train_gpt.parse_args(["--help"])
    assert "`tp` always means Megatron tensor parallelism" in " ".join(text.getvalue().split())
    text = io.StringIO()
    with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    assert "tp is Megatron tensor parallelism" in " ".join(text.getvalue().split())


@pytest.mark.serial
def test_a_pasted_layout_with_zero1_and_sequence_parallel_equals_one_process(tmp_path):
    """``--layout tp=2,pp=1,dp=2,sp=1,zero=1`` at 4 ranks (Megatron TP with sequence parallelism, ZeRO-1 over the
    2 data ranks) on the character corpus: the losses of every step and the final weights equal one process (both
    pad the vocabulary to a multiple of 2, so that both draw the same initial weights)."""
    base = [*TINY, "--corpus-bytes", "20000", "--steps", "3", "--no-save", "--make-vocab-size-divisible-by", "2",
            "--dump-params"]
    _run([*base, "one.npz", "--metrics-json", "one.jsonl"], tmp_path)
    r = _run([*base, "four.npz", "--metrics-json", "four.jsonl", "--layout", "tp=2,pp=1,dp=2,sp=1,zero=1"],
             tmp_path, n=4)
    assert "tp-style megatron" in r.stderr
    for a, b in zip(_rows(tmp_path / "one.jsonl"), _rows(tmp_path / "four.jsonl")):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-10), (a, b)
    want, got = np.load(tmp_path / "one.npz"), np.load(tmp_path / "four.npz")
    for k in want.files:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.mpi(min_size=1)
def test_recipe_pads_unpadded_weights_on_load_and_is_a_training_state(world, tmp_path_factory):
    """Megatron TP over every rank on a vocabulary of 97, padded to divide: the serial (unpadded, HF-shaped) weights
    load into the padded recipe (zero rows appended; on main: "'wte.weight' has shape (97, 24); expected (98, 24)")
    with the serial loss; ``checkpoint.training_state`` takes the recipe object (on main: TypeError)."""
    import axonmpi
    from axonmpi import checkpoint as ckpt
    from axonmpi.models import GPT, GPTConfig
    from axonmpi.models.gpt import padded_vocab_size
    from axonmpi.optim import AdamW
    from axonmpi.recipes import HybridGPT
    n = world.world_size
    grid = axonmpi.ProcessGrid(world, G_data=1, G_inter=1, G_intra_r=1, G_intra_c=n, G_intra_d=1)
    shape = dict(vocab_size=97, block_size=8, n_layer=1, n_head=12, n_embd=24)
    axonmpi.manual_seed(0)
    serial = GPT(GPTConfig(**shape), dtype=np.float64)
    pad = padded_vocab_size(97, 1, n)
    hyb = HybridGPT(GPTConfig(**shape, padded_vocab_size=None if pad == 97 else pad), grid,
                    tp_style="megatron" if n > 1 else "axonn", dtype="float64", global_batch=4)
    hyb.load_full_state_dict(serial.state_dict())
    full = hyb.full_state_dict()
    assert full["wte.weight"].shape == (pad, 24)
    for k, v in serial.state_dict().items():
        np.testing.assert_array_equal(full[k][:v.shape[0]], v, err_msg=k)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 97, (4, 8)), rng.integers(0, 97, (4, 8))
    want = float(serial(x, y)[1].item())
    assert hyb.eval_loss(hyb.local_batch(x), hyb.local_batch(y)) == pytest.approx(want, rel=1e-12)
    opt = AdamW(hyb.parameters(), lr=1e-3)
    d = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("recipe") / "ck") if world.rank == 0 else None)
    ckpt.save(d, ckpt.training_state(hyb, opt, step=3))
    loaded = ckpt.load(d, hyb.checkpoint_template(d), strict=False)
    assert ckpt.restore_training_state(loaded, hyb, opt)["step"] == 3
