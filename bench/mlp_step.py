"""One MLP training step (forward, cross-entropy, backward, Adam) beside the hand-written NumPy anchor.

Runs ``../shared/anchors/numpy_mpi_mlp.py`` as a subprocess and axonmpi's step in this
process, interleaved ``--repeats`` times, and prints the best step time of each, samples/s
and the ratio axonmpi / anchor (target <= 1.15). Both use one BLAS/OpenMP thread.

Usage:
    python bench/mlp_step.py                  # HIDDEN=2048 BATCH=128 STEPS=30 as the anchor
    HIDDEN=1024 STEPS=10 python bench/mlp_step.py --repeats 1
    python bench/mlp_step.py --profile        # also: where axonmpi's step time goes (cProfile)
    python bench/mlp_step.py --model gpt      # the GPT step (4 layers x 4 heads x 256, vocab 96, 8 x 128
                                              # tokens, AdamW) beside transformers' GPT2LMHeadModel
    python bench/mlp_step.py --model gpt --profile

``--model gpt`` interleaves the two steps in this process and prints wall and CPU time (``process_time``:
what the step itself used, steadier than wall time when other processes share the cores), min and median.
"""
from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before NumPy loads BLAS, and inherited by the anchor
os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ANCHOR = os.path.join(ROOT, "..", "shared", "anchors", "numpy_mpi_mlp.py")

import axonmpi.nn as nn  # noqa: E402
import axonmpi.nn.functional as F  # noqa: E402
from axonmpi.autograd import Tensor  # noqa: E402
from axonmpi.optim import Adam  # noqa: E402

D_IN, D_OUT = 784, 10
H = int(os.environ.get("HIDDEN", "2048"))
B = int(os.environ.get("BATCH", "128"))
STEPS = int(os.environ.get("STEPS", "30"))
WARMUP = 5


def run_anchor() -> float:
    """Step time in seconds reported by the anchor (one rank, no mpiexec needed)."""
    out = subprocess.run([sys.executable, ANCHOR], capture_output=True, text=True, check=True).stdout
    m = re.search(r"step=([0-9.]+) ms", out)
    if m is None:
        raise RuntimeError(f"could not find 'step=... ms' in the anchor's output:\n{out}")
    return float(m.group(1)) / 1e3


def make_step():
    """The axonmpi model, data and optimizer; returns a function doing one training step."""
    model = nn.Sequential(nn.Linear(D_IN, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, D_OUT))
    opt = Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((B, D_IN)).astype(np.float32))
    y = rng.integers(0, D_OUT, B)

    def step(phases=None):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        if phases is not None:
            phases += np.array([t1 - t0, t2 - t1, time.perf_counter() - t2])
        return loss

    return step


def time_axonmpi(step) -> float:
    for _ in range(WARMUP):
        step()
    t = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - t) / STEPS


def make_gpt_steps():
    """The GPT step of issue 41 in axonmpi and (if transformers is installed) in PyTorch; each returns its loss."""
    import axonmpi
    from axonmpi.models import GPT, GPTConfig
    from axonmpi.optim import AdamW

    V, T, Bn, L, Hn, C = 96, 128, 8, 4, 4, 256
    rng = np.random.default_rng(0)
    idx, tgt = rng.integers(0, V, (Bn, T)), rng.integers(0, V, (Bn, T))
    axonmpi.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=Hn, n_embd=C))
    opt = AdamW(model.parameters(), lr=1e-3)

    def ours(phases=None):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(idx, tgt)[1]
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        if phases is not None:
            phases += np.array([t1 - t0, t2 - t1, time.perf_counter() - t2])
        return loss

    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging as hf_logging
    except ImportError:
        return ours, None
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    tm = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=C, n_layer=L, n_head=Hn, resid_pdrop=0.0,
                                    embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False, bos_token_id=0,
                                    eos_token_id=0))
    topt = torch.optim.AdamW(tm.parameters(), lr=1e-3)
    ti, tt = torch.from_numpy(idx), torch.from_numpy(tgt)

    def theirs():
        topt.zero_grad()
        loss = tm(input_ids=ti, labels=tt).loss
        loss.backward()
        topt.step()
        return loss

    return ours, theirs


def gpt_main(args) -> None:
    ours, theirs = make_gpt_steps()
    sides = {"axonmpi GPT": ours} if theirs is None else {"axonmpi GPT": ours, "torch GPT2LMHeadModel": theirs}
    wall = {k: [] for k in sides}
    cpu = {k: [] for k in sides}
    for f in sides.values():
        f()
        f()
    for _ in range(args.repeats * 5):
        for k, f in sides.items():
            w, c = time.perf_counter(), time.process_time()
            f()
            wall[k].append(time.perf_counter() - w)
            cpu[k].append(time.process_time() - c)
    load = " ".join(open("/proc/loadavg").read().split()[:3]) if os.path.exists("/proc/loadavg") else "?"
    print(f"GPT step: 4 layers x 4 heads x 256, vocab 96, 8 x 128 tokens, AdamW, float32, 1 thread; "
          f"{args.repeats * 5} interleaved steps each; load average {load}")
    print(f"{'implementation':<24}{'wall min':>10}{'median':>9}{'cpu min':>10}{'median':>9}  (ms)")
    for k in sides:
        print(f"{k:<24}{1e3 * min(wall[k]):>10.1f}{1e3 * np.median(wall[k]):>9.1f}"
              f"{1e3 * min(cpu[k]):>10.1f}{1e3 * np.median(cpu[k]):>9.1f}")
    if theirs is not None:
        a, b = "axonmpi GPT", "torch GPT2LMHeadModel"
        print(f"ratio axonmpi / torch: wall min {min(wall[a]) / min(wall[b]):.2f}, median "
              f"{np.median(wall[a]) / np.median(wall[b]):.2f}; cpu median {np.median(cpu[a]) / np.median(cpu[b]):.2f}")
    else:
        print("torch or transformers not installed: the PyTorch row is skipped (pip install torch==2.13.0 transformers)")
    if args.profile:
        phases = np.zeros(3)
        for _ in range(5):
            ours(phases)
        ms = phases / 5 * 1e3
        print(f"\nper step: forward+loss {ms[0]:.1f} ms, backward {ms[1]:.1f} ms, AdamW {ms[2]:.1f} ms")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            ours()
        prof.disable()
        print("\nwhere axonmpi's GPT step goes (5 steps, sorted by own time):")
        pstats.Stats(prof, stream=sys.stdout).strip_dirs().sort_stats("tottime").print_stats(args.top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["mlp", "gpt"], default="mlp",
                    help="mlp: beside the NumPy anchor; gpt: the GPT step beside PyTorch")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs of each; the best is reported")
    ap.add_argument("--profile", action="store_true", help="print a phase split and cProfile's top entries")
    ap.add_argument("--top", type=int, default=15, help="profile entries to print")
    args = ap.parse_args()
    if args.model == "gpt":
        gpt_main(args)
        return

    step = make_step()
    n_params = 784 * H + H + H * H + H + H * D_OUT + D_OUT
    have_anchor = os.path.exists(ANCHOR)
    anchor, ours = [], []
    for _ in range(args.repeats):
        if have_anchor:
            anchor.append(run_anchor())
        ours.append(time_axonmpi(step))
    a, o = (min(anchor) if anchor else float("nan")), min(ours)
    print(f"MLP {D_IN}-{H}-{H}-{D_OUT} ({n_params / 1e6:.2f}M params, float32), batch {B}, "
          f"{STEPS} steps, best of {args.repeats}, OMP/OPENBLAS threads 1")
    print(f"{'implementation':<28}{'step ms':>10}{'samples/s':>12}{'ratio':>8}")
    if have_anchor:
        print(f"{'numpy anchor (hand-written)':<28}{a * 1e3:>10.1f}{B / a:>12.0f}{1.0:>8.2f}")
    print(f"{'axonmpi nn+autograd+Adam':<28}{o * 1e3:>10.1f}{B / o:>12.0f}"
          + (f"{o / a:>8.2f}" if have_anchor else f"{'n/a':>8}"))
    if not have_anchor:
        print(f"note: anchor comparison skipped: {os.path.normpath(ANCHOR)} not found (it lives in ../shared/anchors "
              "beside the repository)")

    if args.profile:
        phases = np.zeros(3)
        for _ in range(STEPS):
            step(phases)
        ms = phases / STEPS * 1e3
        print(f"\nper step: forward+loss {ms[0]:.1f} ms, backward {ms[1]:.1f} ms, Adam {ms[2]:.1f} ms")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(STEPS):
            step()
        prof.disable()
        print(f"\nwhere axonmpi's time goes ({STEPS} steps, sorted by own time):")
        pstats.Stats(prof, stream=sys.stdout).strip_dirs().sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
