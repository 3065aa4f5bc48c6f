"""GPT training step time on GPUs: axonmpi's GPT + DDP (NCCL) + AdamW on CuPy at 1..N GPUs.

For each rank count in --ranks (default 1 .. number of GPUs) this launches
``mpiexec -n K python bench/gpu.py --worker`` (one rank per GPU, bound by local rank), trains the
char-GPT shape of examples/train_gpt.py (sizes below) on random tokens with a fixed local batch
per GPU (weak scaling), and prints ms/step (median of the timed steps, the device synchronized
at each step's end), tokens/s over all GPUs, TFLOP/s and MFU per GPU and the scaling efficiency against one GPU.
Without CuPy, NCCL or a GPU it stops with a message (exit status 2), unless ``--cpu``.

``--cpu`` (no GPU needed, one process): the host side of the same step on this machine's CPU, so every change
is measured before a GPU is lent: host ms per step and array operations ("kernels") per step of axonmpi's
eager step and of its replay (``axonmpi.compile``), beside PyTorch eager (transformers' ``GPT2LMHeadModel`` of
the same shape, AdamW, clipping) in the same invocation, its steps interleaved with ours. Kernels per step are
counted by :mod:`axonmpi.graphs.count` (every NumPy operation on the step's arrays: the kernels a GPU
launches for the NumPy/CuPy path) and, for torch, by a dispatch mode counting ATen ops.

    python bench/gpu.py --cpu --preset overhead # 12 layers x 12 heads at width 48, 16 tokens, batch 1
    python bench/gpu.py --cpu --preset gpt2 --block-size 64 --batch 1 --count-only  # GPT-2 124M: kernels per step
    python bench/gpu.py                         # 1 .. all GPUs of this node
    python bench/gpu.py --ranks 1 --preset gpt2 --precision bf16 --profile prof.txt   # 124M, MFU, host split
    python bench/gpu.py --ranks 1 4 --n-layer 8 --n-embd 512 --batch 32
    mpiexec -n 2 python bench/gpu.py --worker   # one run, one result line
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


PRESETS = {  # name: (n_layer, n_head, n_embd, block_size, vocab, batch)
    "char": (6, 6, 384, 256, 96, 16),          # examples/train_gpt.py's shape
    "gpt2": (12, 12, 768, 1024, 50304, 8),     # GPT-2 small (124M), vocabulary padded to a multiple of 64
    "overhead": (12, 12, 48, 16, 96, 1),       # GPT-2 small's depth and heads at width 48: the host-bound step
}
# dense peak FLOP/s of one GPU by (name fragment, precision); MFU is measured rate over these
PEAKS = {("H100", "fp32"): 66.9e12, ("H100", "tf32"): 494.7e12, ("H100", "bf16"): 989.4e12,
         ("H100", "fp16"): 989.4e12, ("H200", "fp32"): 66.9e12, ("H200", "tf32"): 494.7e12,
         ("H200", "bf16"): 989.4e12, ("H200", "fp16"): 989.4e12}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help="one run under mpiexec (prints one result line)")
    ap.add_argument("--cpu", action="store_true", help="no GPU: host ms and kernels per step, eager vs replay vs "
                                                       "torch eager, on this CPU (one process)")
    ap.add_argument("--no-torch", action="store_true", help="--cpu without the PyTorch column")
    ap.add_argument("--count-only", action="store_true", help="--cpu: kernels per step only, no timed steps "
                                                              "(GPT-2 124M on a CPU)")
    ap.add_argument("--compile", action="store_true", help="GPU: run the step through axonmpi.compile (the static "
                                                           "replay; the reason if the step cannot be captured)")
    ap.add_argument("--cuda-graph", action="store_true", help="with --compile: a CUDA graph (AdamW's host step "
                                                              "count makes the capture refuse or the update stale)")
    ap.add_argument("--ranks", type=int, nargs="*", default=None, help="rank counts (default 1 .. GPUs)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="char",
                    help="model shape: char (examples/train_gpt.py) or gpt2 (124M, context 1024)")
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("--n-head", type=int, default=None)
    ap.add_argument("--n-embd", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size")
    ap.add_argument("--batch", type=int, default=None, help="sequences per GPU per step")
    ap.add_argument("--precision", choices=["fp32", "tf32", "bf16", "fp16", "fp64"], default="fp32",
                    help="fp32/fp64: plain; tf32: fp32 with TF32 tensor-core GEMMs (CUPY_TF32=1); bf16/fp16: "
                         "mixed precision (FSDP MixedPrecision: low-precision compute, fp32 master weights and "
                         "gradient reduction)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="after the timed steps, profile 3 steps with cProfile and write the report to FILE")
    a = ap.parse_args(argv)
    for k, v in zip(("n_layer", "n_head", "n_embd", "block_size", "vocab", "batch"), PRESETS[a.preset]):
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def flops_per_token(n_params: int, a) -> float:
    """PaLM's count: 6N for the weights' matrix products plus 12 L d T for attention's."""
    return 6.0 * n_params + 12.0 * a.n_layer * a.n_embd * a.block_size


def peak_flops(gpu_name: str, precision: str):
    for (frag, prec), v in PEAKS.items():
        if frag in gpu_name and prec == precision:
            return v
    return None


def profile_steps(step, nsteps: int, path: str, rank: int) -> str:
    """cProfile ``nsteps`` calls of ``step``; write the top functions to ``path``; return a one-line split
    of host time into kernel launches / array ops, allocator, host syncs and axonmpi's own Python."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(nsteps):
        step()
    prof.disable()
    st = pstats.Stats(prof)
    cats = {"axonmpi python": 0.0, "cupy launches/array ops": 0.0, "allocator": 0.0, "host syncs": 0.0,
            "other": 0.0}
    for (fname, _line, func), (_cc, _nc, tt, _ct, _callers) in st.stats.items():
        f = f"{fname}:{func}"
        if any(k in func for k in ("synchronize", "asnumpy", "item", "tolist")) or func in ("get",):
            cats["host syncs"] += tt
        elif "memory" in fname and "cupy" in fname or "malloc" in func or "alloc" in func:
            cats["allocator"] += tt
        elif "axonmpi" in fname:
            cats["axonmpi python"] += tt
        elif "cupy" in f or fname == "~":
            cats["cupy launches/array ops"] += tt
        else:
            cats["other"] += tt
    total = sum(cats.values())
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    with open(path, "w") as fh:
        fh.write(f"rank {rank}: {nsteps} steps, host time by category (s): {cats}\n\n{buf.getvalue()}")
    return ", ".join(f"{k} {v / total * 100:.0f}%" for k, v in cats.items()) + f" (host {total / nsteps * 1e3:.1f} ms/step)"


def no_gpu_reason():
    """Why this bench cannot run here, or None."""
    from axonmpi import backend
    try:
        import cupy  # noqa: F401
    except Exception as e:
        return (f"CuPy is not installed ({type(e).__name__}: {e}); pip install 'axonmpi[cuda12]' (or measure the "
                "host side on this CPU: bench/gpu.py --cpu)")
    if not backend.cupy_available():
        return "CuPy sees no CUDA GPU on this machine (run it on a GPU node)"
    from axonmpi.distributed.backends import nccl_available
    if not nccl_available():
        return "CuPy has no NCCL here (pip install nvidia-nccl-cu12)"
    return None


def worker(a) -> int:
    if a.precision == "tf32":
        os.environ["CUPY_TF32"] = "1"      # read by CuPy's cuBLAS calls: fp32 GEMMs on tensor cores
    import numpy as np
    from mpi4py import MPI
    reason = no_gpu_reason()
    if reason is not None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"bench/gpu.py: {reason}", file=sys.stderr)
        return 2
    import cupy as cp
    import axonmpi
    from axonmpi.models import GPT, GPTConfig
    from axonmpi.optim import AdamW, clip_grad_norm_
    from axonmpi.parallel import DDP
    world = axonmpi.init(device="cuda")
    n, r = world.world_size, world.rank
    axonmpi.random.manual_seed(0)
    cfg = GPTConfig(vocab_size=a.vocab, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd)
    model = GPT(cfg, dtype=np.float64 if a.precision == "fp64" else np.float32).to(world.device)
    params = sum(p.data.size for p in model.parameters())
    if a.precision in ("bf16", "fp16"):
        from axonmpi.parallel import FSDP, MixedPrecision, ShardingStrategy
        low = "bfloat16" if a.precision == "bf16" else np.float16
        model = FSDP(model, sharding_strategy=ShardingStrategy.NO_SHARD,
                     mixed_precision=MixedPrecision(param_dtype=low, reduce_dtype=np.float32))
    elif n > 1:
        model = DDP(model)
    opt = AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    rng = cp.random.default_rng(1 + r)
    stream = cp.cuda.get_current_stream()
    batches = [(rng.integers(0, a.vocab, (a.batch, a.block_size)), rng.integers(0, a.vocab, (a.batch, a.block_size)))
               for _ in range(4)]
    state = {"i": 0}

    def step():
        x, y = batches[state["i"] % len(batches)]
        state["i"] += 1
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    compiled = None
    if a.compile:
        compiled = step = axonmpi.compile(step, warmup=max(a.warmup - 1, 0), cuda_graph=a.cuda_graph)
    times = []
    for i in range(a.warmup + a.steps):
        stream.synchronize()
        t0 = time.perf_counter()
        loss = step()
        stream.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    last_loss = float(loss.item())
    slowest = world.default_group.comm.allreduce(float(np.median(times)), op=MPI.MAX)
    split = ""
    if a.profile:
        split = profile_steps(step, 3, a.profile if n == 1 else f"{a.profile}.rank{r}", r)
        stream.synchronize()
    pool = cp.get_default_memory_pool()
    if r == 0:
        name = cp.cuda.runtime.getDeviceProperties(world.device.index)["name"].decode()
        tps = n * a.batch * a.block_size / slowest
        fpt = flops_per_token(params, a)
        peak = peak_flops(name, a.precision)
        mfu = tps * fpt / (n * peak) if peak else float("nan")
        print(f"RESULT ranks={n} ms_per_step={slowest * 1e3:.2f} tokens_per_s={tps:.0f} params={params} "
              f"mfu={mfu:.4f} tflops={tps * fpt / n / 1e12:.2f} loss={last_loss:.4f} "
              f"pool_gib={pool.total_bytes() / 2**30:.2f} gpu={name.replace(' ', '_')}", flush=True)
        if split:
            print(f"PROFILE {split}", flush=True)
        if compiled is not None:
            print(f"COMPILE kind={compiled.kind} replays={compiled.replays} reason={compiled.reason}", flush=True)
    return 0


def main(argv=None) -> int:
    a = parse(argv)
    if a.cpu:
        import importlib.util
        here = os.path.dirname(os.path.abspath(__file__))
        # bench/ itself off the path: transformers imports the hub's ``kernels``, which bench/kernels.py would shadow
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        spec = importlib.util.spec_from_file_location("_gpu_cpu", os.path.join(here, "_gpu_cpu.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.cpu_bench(a)
    if a.worker:
        return worker(a)
    reason = no_gpu_reason()
    if reason is not None:
        print(f"bench/gpu.py: {reason}", file=sys.stderr)
        return 2
    from axonmpi.backend import device_count
    ranks = a.ranks or list(range(1, device_count() + 1))
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else "mpiexec"
    passthru = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                if k not in ("worker", "ranks") and v is not None]
    print(f"GPT {a.n_layer} layers x {a.n_embd} wide, {a.n_head} heads, context {a.block_size}, vocab {a.vocab}, "
          f"{a.batch} sequences per GPU, {a.precision}, DDP over NCCL, AdamW + clipping; median of {a.steps} steps; "
          "MFU = tokens/s x (6N + 12 L d T) / peak")
    print(f"{'GPUs':>5} {'ms/step':>9} {'tokens/s':>11} {'TFLOP/s':>8} {'MFU':>6} {'efficiency':>10}  gpu")
    base = None
    for k in ranks:
        res = subprocess.run([mpiexec, "-n", str(k), sys.executable, os.path.abspath(__file__), "--worker", *passthru],
                             capture_output=True, text=True)
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")), None)
        if res.returncode != 0 or line is None:
            print(f"{k:>5} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
            return 1
        f = dict(kv.split("=", 1) for kv in line.split()[1:])
        tps = float(f["tokens_per_s"])
        base = tps if base is None and k == ranks[0] else base
        eff = tps / (base * k / ranks[0]) if base else float("nan")
        print(f"{k:>5} {float(f['ms_per_step']):9.2f} {tps:11.0f} {float(f['tflops']):8.2f} "
              f"{float(f['mfu']) * 100:5.1f}% {eff:10.2f}  {f['gpu']}", flush=True)
        for tag in ("PROFILE", "COMPILE"):
            extra = next((ln for ln in res.stdout.splitlines() if ln.startswith(tag)), None)
            if extra:
                print(f"      {extra}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
