"""Hybrid layouts of the GPT at N ranks: measured tokens/s and bytes per group beside the planner's.

One invocation runs everything (each layout is ``examples/train_gpt.py`` under ``mpiexec -n N``,
the user-facing path, with the backend's byte counter of ``bench/_backend_count.py`` installed):

    python bench/hybrid.py                                   # 8 layers, width 512, block 128, 4 ranks
    python bench/hybrid.py --layers 2 --width 128 --steps 3  # quicker

Rows: one per layout ``(G_data, G_inter, G_r, G_c, G_d)`` (and ``+fsdp``: FSDP full_shard over data).
Measured: the median tokens/s of the steps after the first (warm-up), from ``--metrics-json``; with
``--repeats R`` the best of R interleaved rounds (other jobs on the machine come and go).
Predicted: ``axonmpi.plan.estimate`` with what ``axonmpi.plan.measure_bandwidth`` measures under
``mpiexec -n N`` (what ``axonmpi plan --hardware cpu --measure`` uses): the GEMM's flop rate, the
bandwidth and the latency (what a 4 MiB and an 8-byte all-reduce add to a loop of GEMMs), the cores the N ranks get in effect
(from a GEMM timed alone and on all ranks at once: ranks sharing cores, with each other or with other
jobs, stretch compute), our autograd's other kernels (GELU, LayerNorm, the attention core, adds, AdamW,
copies: ``plan.measure_kernels``) and the cores in effect for memory-bound work.  ``--flops-from
serial`` instead takes one flop rate for everything, the model's flops of one step over the CPU seconds
of a 1-rank step (the kernels folded in).  The header also prints the 1-rank step, measured and
predicted (and the GEMMs' part of it).
Column ``cores``: the ranks' CPU seconds over the wall seconds while each layout ran (information:
how loaded the machine was; MPI's busy waiting counts as busy).
Bytes: what every rank moved through the backend per group during the last complete step (from one
``zero_grad`` to the next), the busiest rank's, beside the planner's volume (``meas/pred`` in KiB;
the ratio in the last column is the worst over the groups).  Spearman's rank correlation of the
predicted and measured step times closes the table.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
COUNTER = os.path.join(ROOT, "bench", "_backend_count.py")
LAYOUTS = [(2, 2, 1, 1, 1), (2, 1, 1, 2, 1), (1, 2, 1, 2, 1), (1, 2, 1, 1, 2), (1, 1, 2, 1, 2), (1, 1, 2, 2, 1),
           (4, 1, 1, 1, 1), ((4, 1, 1, 1, 1), "full_shard"), ((2, 1, 1, 2, 1), "full_shard")]
#: Hardware without the kernels besides the GEMMs (the flop rate alone: the model before issue 33).
GEMM_ONLY = dict(attn_flops=0.0, gelu=0.0, layernorm=0.0, softmax=0.0, add=0.0, adam=0.0, copy=0.0)
GROUP_OF = {"col_group": "col", "row_group": "row", "depth_group": "depth", "inter_group": "inter",
            "data_group": "data", "world": "repl", "intra_group": "repl"}


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
    """Run one layout; returns (median tokens/s, {group: bytes of the last step, busiest rank}, error).

    The dict also holds ``_cpu`` (CPU seconds of all ranks per step) and ``_cores`` (those over the wall
    seconds: the cores the ranks kept busy, computing or spinning in MPI), over the steps after the first."""
    from axonmpi.testing import mpiexec_env, run_mpiexec
    metrics = os.path.join(tmp, f"{name}.jsonl")
    counts = os.path.join(tmp, f"{name}.count")
    argv = [SCRIPT, "--n-layer", str(args.layers), "--n-embd", str(args.width), "--n-head", str(args.heads),
            "--block-size", str(args.block), "--global-batch", str(args.global_batch), "--steps", str(args.steps),
            "--no-save", "--no-progress", "--sample-chars", "0", "--eval-batches", "1", "--corpus-bytes", "200000",
            "--dtype", args.dtype, "--metrics-json", metrics, *extra]
    if sizes is None:
        r = subprocess.run([sys.executable, COUNTER, counts, *argv], capture_output=True, text=True, env=mpiexec_env(),
                           cwd=tmp)
    else:
        flags = [f for k, v in zip(("--G-data", "--G-inter", "--G-intra-r", "--G-intra-c", "--G-intra-d"), sizes)
                 for f in (k, str(v))]
        r = run_mpiexec([COUNTER, counts] + argv + flags, n=args.ranks, timeout=3600, cwd=tmp)
    if r.returncode != 0:
        return None, None, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
    rows = [json.loads(x) for x in open(metrics)]
    tok = statistics.median(x["tokens_per_s"] for x in rows[1:]) if len(rows) > 1 else rows[0]["tokens_per_s"]
    per_group = {"_cpu": 0.0, "_wall": 0.0}
    for f in glob.glob(counts + ".*.json"):
        snaps = json.load(open(f))["snapshots"]
        if len(snaps) < 2:
            continue
        first = snaps[1] if len(snaps) > 2 else snaps[0]
        per_group["_cpu"] += (snaps[-1]["_clock"][0] - first["_clock"][0]) / (len(snaps) - 1 - snaps.index(first))
        per_group["_wall"] = max(per_group["_wall"], snaps[-1]["_clock"][1] - first["_clock"][1])
        a, b = snaps[-2], snaps[-1]
        mine = {}
        for g, v in b.items():
            kind, nbytes = GROUP_OF.get(g), v[0]
            if kind is not None:
                mine[kind] = mine.get(kind, 0) + nbytes - a.get(g, [0, 0])[0]
        for k, v in mine.items():
            per_group[k] = max(per_group.get(k, 0), v)
        nsteps = len(snaps) - 1 - snaps.index(first)
    per_group["_cores"] = per_group["_cpu"] * nsteps / per_group["_wall"] if per_group["_wall"] else 0.0
    return tok, per_group, None


def _vocab() -> int:
    """The character vocabulary train_gpt.py builds from its corpus (the head's width)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from axonmpi.data import CharTokenizer, load_stdlib_corpus
    return CharTokenizer(load_stdlib_corpus(max_bytes=200000)).vocab_size


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds over the layouts; the best tokens/s kept")
    p.add_argument("--only", nargs="+", metavar="LABEL", help="run only these layouts, e.g. 2x1x1x2x1-full_shard 4x1x1x1x1")
    p.add_argument("--flops-from", choices=["measure", "serial"], default="measure",
                   help="the flop rate: measure_bandwidth's GEMM (what `axonmpi plan --hardware cpu --measure` "
                        "uses) or the model's flops over a 1-rank step's CPU seconds")
    args = p.parse_args()
    from axonmpi.plan import GROUPS, Hardware, Layout, Model, estimate
    from axonmpi.testing import run_mpiexec
    tmp = tempfile.mkdtemp()
    model = Model(layers=args.layers, width=args.width, seq=args.block, global_batch=args.global_batch,
                  vocab=_vocab(), dtype_bytes=4 if args.dtype == "float32" else 8, heads=args.heads)
    serial, one, err = _train(args, tmp, "serial", None)
    if serial is None:
        sys.exit(f"the 1-rank run failed: {err}")
    # flop/s of one rank alone on a core: the model's flops over the CPU seconds of a 1-rank step
    flops = estimate(model, Layout(), Hardware(flops=1.0)).compute_time / one["_cpu"]
    r = run_mpiexec(["-c", "import json, axonmpi\nfrom axonmpi.plan import measure_bandwidth\n"
                     f"bw = measure_bandwidth(1 << 22, width={args.width}, seq={args.block}, heads={args.heads}, "
                     f"dtype={args.dtype!r})\nif axonmpi.get_world().rank == 0: print(json.dumps(bw))"],
                    n=args.ranks, timeout=600)
    if r.returncode != 0:
        sys.exit(f"measure_bandwidth failed: {r.stderr.strip()[-2000:]}")
    bw = json.loads(r.stdout.strip().splitlines()[-1])
    cores = bw["cores"]
    if args.flops_from == "measure":
        flops = bw["flops"]
    hw = replace(Hardware.from_measured(bw, args.ranks), flops=flops)
    if args.flops_from == "serial":      # the 1-rank step's CPU seconds hold every kernel: GEMM flops only
        hw = replace(hw, **GEMM_ONLY)
    print(f"GPT {args.layers} layers x width {args.width}, block {args.block}, vocab {model.vocab}, global batch "
          f"{args.global_batch}, {args.dtype}, {args.ranks} ranks, {args.steps} steps | 1 rank: {serial:,.0f} tokens/s "
          f"({flops / 1e9:.1f} GFLOP/s per CPU second) | all-reduce bus bandwidth {bw['intra'] / 1e9:.2f} GB/s "
          f"between GEMMs ({bw.get('intra_alone', bw['intra']) / 1e9:.2f} back to back), "
          f"{bw['latency'] * 1e6:.0f} us a call between GEMMs, {cores:.2f} cores in effect for "
          f"{args.ranks} ranks | per element, forward + backward, alone: GELU {hw.gelu * 1e9:.1f} ns, LayerNorm "
          f"{hw.layernorm * 1e9:.1f} ns, attention score {hw.softmax * 1e9:.1f} ns, add {hw.add * 1e9:.2f} ns; "
          f"AdamW + clipping {hw.adam * 1e9:.1f} ns a parameter; attention matmuls {hw.attn_flops / 1e9:.1f} GFLOP/s; "
          f"{hw.mem_cores:.2f} cores in effect for memory-bound work",
          flush=True)
    one_rank = replace(hw, cores=0.0, mem_cores=0.0)
    alone = estimate(model, Layout(), one_rank).step_time
    gemms = estimate(model, Layout(), replace(one_rank, **GEMM_ONLY)).step_time
    print(f"1 rank: measured {args.global_batch * args.block / serial * 1e3:.0f} ms a step, predicted "
          f"{alone * 1e3:.0f} ms (GEMMs {gemms * 1e3:.0f} ms of it)", flush=True)
    todo = []
    for entry in LAYOUTS:
        sizes, fsdp = (entry if isinstance(entry[1], str) else (entry, None))
        label = "x".join(map(str, sizes)) + (f"-{fsdp}" if fsdp else "")
        if sizes[0] * sizes[1] * sizes[2] * sizes[3] * sizes[4] == args.ranks and (not args.only or label in args.only):
            todo.append((sizes, fsdp))
    best = {}
    for rnd in range(args.repeats):              # interleaved rounds, the best kept: other jobs come and go
        for sizes, fsdp in todo:
            m = args.microbatches if sizes[1] > 1 else 1
            extra = ["--microbatches", str(m)] + (["--fsdp", fsdp] if fsdp else [])
            name = "x".join(map(str, sizes)) + (f"-{fsdp}" if fsdp else "") + f"-{rnd}"
            tok, counted, err = _train(args, tmp, name, sizes, extra)
            old = best.get((sizes, fsdp))
            if old is None or (tok is not None and (old[0] is None or tok > old[0])):
                best[(sizes, fsdp)] = (tok, counted, err)
    rows = []
    for sizes, fsdp in todo:
        m = args.microbatches if sizes[1] > 1 else 1
        tok, counted, err = best[(sizes, fsdp)]
        rows.append((sizes, fsdp, m, tok, counted, err, estimate(model, Layout(*sizes), hw, microbatches=m, fsdp=fsdp)))
    ok = [r for r in rows if r[3] is not None]
    rho, rm, rp = _spearman([args.global_batch * args.block / r[3] for r in ok], [r[6].step_time for r in ok])
    rank_of = {id(r): (a, b) for r, a, b in zip(ok, rm, rp)}
    b = model.dtype_bytes
    ratios = []
    print(f"{'layout (d,i,r,c,d)':<24} {'m':>2} {'cores':>5} {'tokens/s':>9} {'vs 1':>5} {'step ms':>8} {'pred ms':>8} "
          f"{'rank':>4} {'pred':>4} {'p/m':>5}  " + " ".join(f"{g + ' KiB meas/pred':>21}" for g in GROUPS) + f" {'worst':>6}")
    for r in rows:
        sizes, fsdp, m, tok, counted, err, pred = r
        label = str(sizes) + (f" {fsdp}" if fsdp else "")
        if tok is None:
            print(f"{label:<24} {m:>2} failed: {err}")
            continue
        a, c = rank_of[id(r)]
        step = args.global_batch * args.block / tok
        cells, worst = [], 1.0
        for g in GROUPS:
            meas, want = counted.get(g, 0), pred.volumes[g] * b
            cells.append(f"{meas / 1024:>10.0f}/{want / 1024:<10.0f}" if meas or want else f"{'-':>21}")
            if meas or want:
                ratio = meas / want if want else float("inf")
                worst = ratio if abs(ratio - 1) > abs(worst - 1) else worst
        ratios.append(pred.step_time / step)
        print(f"{label:<24} {m:>2} {counted['_cores']:>5.2f} {tok:>9,.0f} {tok / serial:>5.2f} {step * 1e3:>8.0f} "
              f"{pred.step_time * 1e3:>8.0f} {a + 1:>4} {c + 1:>4} {ratios[-1]:>5.2f}  " + " ".join(cells)
              + f" {worst:>6.3f}")
    print(f"Spearman rank correlation (predicted vs measured step time): {rho:.2f} over {len(ok)} layouts "
          f"(target >= 0.9)")
    if ratios:
        far = max(max(r, 1 / r) for r in ratios)
        inside = sum(1 / 1.33 <= r <= 1.33 for r in ratios)
        print(f"predicted / measured step time: {min(ratios):.2f} .. {max(ratios):.2f}; worst factor {far:.2f} "
              f"(target <= 1.33); {inside} of {len(ratios)} layouts within 1.33x (flop rate from {args.flops_from})")


if __name__ == "__main__":
    main()
