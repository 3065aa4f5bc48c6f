"""Hybrid layouts of the GPT at N ranks: measured tokens/s beside the planner's prediction and ranking.

One invocation runs everything (each layout is ``examples/train_gpt.py`` under ``mpiexec -n N``,
the user-facing path):

    python bench/hybrid.py                                   # 8 layers, width 512, block 128, 4 ranks
    python bench/hybrid.py --layers 4 --width 128 --steps 3  # quicker

Rows: one per layout ``(G_data, G_inter, G_r, G_c, G_d)``.  Measured: the median tokens/s of
the steps after the first (warm-up), from ``--metrics-json``.  Predicted: ``axonmpi.plan.estimate``
with the flop rate calibrated on a 1-rank run of the same model and the bandwidth measured
on this machine (``axonmpi.plan.measure_bandwidth`` under ``mpiexec -n N``).  The last line is
Spearman's rank correlation between the predicted and measured step times.  With more ranks than
cores the per-rank flop rate is scaled by cores / ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
LAYOUTS = [(4, 1, 1, 1, 1), (2, 2, 1, 1, 1), (2, 1, 1, 2, 1), (1, 2, 1, 2, 1), (1, 2, 1, 1, 2), (1, 1, 2, 1, 2),
           (1, 1, 2, 2, 1), (1, 4, 1, 1, 1), (1, 1, 1, 4, 1), (1, 1, 4, 1, 1), (1, 1, 1, 1, 4)]


def _spearman(a, b):
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0] * len(v)
        for k, i in enumerate(order):
            r[i] = k
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return float("nan"), list(range(n)), list(range(n))
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb))
    return 1.0 - 6.0 * d2 / (n * (n * n - 1)), ra, rb


def _train(args, tmp, name, sizes, extra=()):
    from axonmpi.testing import mpiexec_env, run_mpiexec
    metrics = os.path.join(tmp, f"{name}.jsonl")
    argv = [SCRIPT, "--n-layer", str(args.layers), "--n-embd", str(args.width), "--n-head", str(args.heads),
            "--block-size", str(args.block), "--global-batch", str(args.global_batch), "--steps", str(args.steps),
            "--no-save", "--no-progress", "--sample-chars", "0", "--eval-batches", "1", "--corpus-bytes", "200000",
            "--dtype", args.dtype, "--metrics-json", metrics, *extra]
    if sizes is None:
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=mpiexec_env(), cwd=tmp)
    else:
        flags = [f for k, v in zip(("--G-data", "--G-inter", "--G-intra-r", "--G-intra-c", "--G-intra-d"), sizes)
                 for f in (k, str(v))]
        r = run_mpiexec(argv + flags, n=args.ranks, timeout=3600, cwd=tmp)
    if r.returncode != 0:
        return None, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
    rows = [json.loads(x) for x in open(metrics)]
    tok = statistics.median(x["tokens_per_s"] for x in rows[1:]) if len(rows) > 1 else rows[0]["tokens_per_s"]
    return tok, None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    from axonmpi.plan import Hardware, Layout, Model, estimate
    from axonmpi.testing import run_mpiexec
    tmp = tempfile.mkdtemp()
    vocab = 94  # the character vocabulary train_gpt.py builds from the corpus (a few more or less is immaterial)
    model = Model(layers=args.layers, width=args.width, seq=args.block, global_batch=args.global_batch, vocab=vocab,
                  dtype_bytes=4 if args.dtype == "float32" else 8)
    serial, err = _train(args, tmp, "serial", None)
    if serial is None:
        sys.exit(f"the 1-rank run failed: {err}")
    t1 = args.global_batch * args.block / serial
    flops = estimate(model, Layout(), Hardware(flops=1.0)).compute_time / t1     # flop/s of one rank
    r = run_mpiexec(["-c", "import json, axonmpi\nfrom axonmpi.plan import measure_bandwidth\n"
                     "bw = measure_bandwidth(1 << 22)\nif axonmpi.get_world().rank == 0: print(json.dumps(bw))"],
                    n=args.ranks, timeout=600)
    bw = json.loads(r.stdout.strip().splitlines()[-1])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = min(1.0, cores / args.ranks)       # ranks oversubscribing the cores share them
    hw = Hardware(bw_intra=bw["intra"], bw_inter=bw["inter"], flops=flops * share, gpus_per_node=args.ranks,
                  latency=bw["latency"])
    print(f"GPT {args.layers} layers x width {args.width}, block {args.block}, global batch {args.global_batch}, "
          f"{args.dtype}, {args.ranks} ranks | 1 rank: {serial:,.0f} tokens/s ({flops / 1e9:.1f} GFLOP/s) | "
          f"all-reduce bus bandwidth {bw['intra'] / 1e9:.2f} GB/s, latency {bw['latency'] * 1e6:.0f} us, "
          f"{cores} cores")
    rows = []
    for sizes in LAYOUTS:
        if sizes[0] * sizes[1] * sizes[2] * sizes[3] * sizes[4] != args.ranks:
            continue
        m = args.microbatches if sizes[1] > 1 else 1
        tok, err = _train(args, tmp, "x".join(map(str, sizes)), sizes, ["--microbatches", str(m)])
        pred = estimate(model, Layout(*sizes), hw, microbatches=m)
        rows.append((sizes, m, tok, err, pred))
    ok = [r for r in rows if r[2] is not None]
    rho, rm, rp = _spearman([args.global_batch * args.block / r[2] for r in ok], [r[4].step_time for r in ok])
    rank_of = {id(r): (a, b) for r, a, b in zip(ok, rm, rp)}
    print(f"{'layout (d,i,r,c,d)':<20} {'m':>2} {'tokens/s':>10} {'speed-up':>8} {'step ms':>9} "
          f"{'pred ms':>9} {'rank':>4} {'pred':>4}")
    for r in rows:
        sizes, m, tok, err, pred = r
        if tok is None:
            print(f"{str(sizes):<20} {m:>2} failed: {err}")
            continue
        a, b = rank_of[id(r)]
        step = args.global_batch * args.block / tok
        print(f"{str(sizes):<20} {m:>2} {tok:>10,.0f} {tok / serial:>8.2f} {step * 1e3:>9.1f} "
              f"{pred.step_time * 1e3:>9.1f} {a + 1:>4} {b + 1:>4}")
    print(f"Spearman rank correlation (predicted vs measured step time): {rho:.2f} over {len(ok)} layouts")


if __name__ == "__main__":
    main()
