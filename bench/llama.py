"""The Llama's training step (forward, cross-entropy, backward) beside transformers' ``LlamaForCausalLM``, and
the block's fused ops beside the same math composed of existing ops.

Both models hold the same weights (``save_hf`` -> ``from_pretrained``); the steps are interleaved
``--repeats`` times and the min / median of each are printed with the ratio axonmpi / peer. The ops table
times ``F.rms_norm``, ``F.apply_rotary_emb`` and ``F.swiglu`` (forward + backward) against their composed
forms (what the layers would cost without ``autograd/ops_llama.py``). ``--device cuda`` runs both on the GPU
(CuPy and torch's CUDA), checking first that the GPU model equals the CPU one in float64 and transformers'
logits in float32. Needs torch and transformers (``make test-interop`` installs them).

Usage:
    python bench/llama.py                                   # CPU, one thread, a small model
    python bench/llama.py --device cuda --width 1024 --layers 4 --batch 8 --seq 512 --vocab 8192
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")     # before NumPy / torch load their thread pools
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# bench/ itself off the path: transformers imports the hub's ``kernels`` package, which bench/kernels.py would shadow
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import axonmpi  # noqa: E402
import axonmpi.nn.functional as F  # noqa: E402
from axonmpi import Tensor, backend  # noqa: E402
from axonmpi.models import Llama, LlamaConfig  # noqa: E402


def _model(cfg, dtype, device):
    axonmpi.manual_seed(0)
    m = Llama(cfg, dtype=dtype)
    rng = np.random.default_rng(0)
    with axonmpi.no_grad():
        for p in m.parameters():
            p.data[...] += (0.02 * rng.standard_normal(p.shape)).astype(p.data.dtype)
    return m.to(device) if device != "cpu" else m


def _rel(a, b):
    a, b = backend.to_host(a), backend.to_host(b)
    return float(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b))))


def _sync(device):
    if device != "cpu":
        import cupy
        cupy.cuda.Device().synchronize()


def check_gpu(torch, transformers):
    """float64: the GPU model equals the CPU one (logits, loss, every gradient); float32: transformers' logits."""
    import cupy
    cfg = LlamaConfig(vocab_size=100, n_embd=64, n_layer=2, n_head=8, n_kv_head=2, intermediate_size=96,
                      block_size=64, rope_theta=500.0, tie_word_embeddings=True,
                      rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 2.0, "original_max_position_embeddings": 16})
    cpu, gpu = _model(cfg, np.float64, "cpu"), _model(cfg, np.float64, "cuda")
    rng = np.random.default_rng(1)
    idx, tgt = rng.integers(0, 100, (3, 40)), rng.integers(0, 100, (3, 40))
    lc, lossc = cpu(idx, tgt, positions=np.arange(10, 50))
    lossc.backward()
    lg, lossg = gpu(cupy.asarray(idx), cupy.asarray(tgt), positions=np.arange(10, 50))
    lossg.backward()
    gp = dict(gpu.named_parameters())
    worst = max([_rel(lg.data, lc.data), _rel(lossg.data, lossc.data)]
                + [_rel(gp[n].grad.data, p.grad.data) for n, p in cpu.named_parameters()])
    print(f"GPU vs CPU, float64 (logits, loss, every gradient): worst relative difference {worst:.2e}")
    ours = _model(cfg, np.float32, "cuda")
    with tempfile.TemporaryDirectory() as d:
        ours.save_hf(d)
        hf = transformers.LlamaForCausalLM.from_pretrained(d).cuda().eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(idx).cuda()).logits.float().cpu().numpy()
    with axonmpi.no_grad():
        mine = ours(cupy.asarray(idx))[0].data
    print(f"GPU vs transformers {transformers.__version__}, float32 logits: relative difference {_rel(mine, theirs):.2e}")


def bench_step(args, torch, transformers):
    dev = args.device
    cfg = LlamaConfig(vocab_size=args.vocab, n_embd=args.width, n_layer=args.layers, n_head=args.heads,
                      n_kv_head=args.kv_heads, intermediate_size=args.ffn, block_size=args.seq)
    ours = _model(cfg, np.float32, dev)
    idx = np.random.default_rng(3).integers(0, args.vocab, (args.batch, args.seq + 1))
    xp = np
    if dev != "cpu":
        import cupy as xp
    x, y = xp.asarray(idx[:, :-1]), xp.asarray(idx[:, 1:])
    tdev = "cuda" if dev != "cpu" else "cpu"
    xt, yt = torch.from_numpy(idx[:, :-1]).to(tdev), torch.from_numpy(idx[:, 1:]).to(tdev)

    def ours_step():
        for p in ours.parameters():
            p.grad = None
        ours(x, y)[1].backward()
        _sync(dev)

    def peer(m):
        def step():
            m.zero_grad(set_to_none=True)
            logits = m(xt).logits
            torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), yt.reshape(-1)).backward()
            if tdev == "cuda":
                torch.cuda.synchronize()
        return step

    steps = {"axonmpi": ours_step}
    with tempfile.TemporaryDirectory() as d:
        ours.save_hf(d)
        for impl in ("sdpa", "eager"):
            m = transformers.LlamaForCausalLM.from_pretrained(d, attn_implementation=impl, dtype=torch.float32)
            steps[f"transformers ({impl})"] = peer(m.to(tdev).train())
    _table(steps, args.repeats, f"training step (forward, loss, backward), float32, {dev}: batch {args.batch} x "
                                f"{args.seq} tokens, width {args.width}, {args.layers} layers, heads {args.heads}/"
                                f"kv {args.kv_heads}, ffn {args.ffn}, vocab {args.vocab}")


def bench_ops(args):
    dev = args.device
    xp = np
    if dev != "cpu":
        import cupy as xp
    rng = np.random.default_rng(4)
    B, T, H, D = args.batch, args.seq, args.heads, args.width // args.heads
    x = Tensor(xp.asarray(rng.standard_normal((B, T, args.width)).astype(np.float32)), requires_grad=True)
    w = Tensor(xp.asarray(np.ones(args.width, np.float32)), requires_grad=True)
    q = Tensor(xp.asarray(rng.standard_normal((B, T, H, D)).astype(np.float32)), requires_grad=True)
    cos, sin = axonmpi.nn.RotaryEmbedding(D)(q)
    cos, sin = cos[:, None, :], sin[:, None, :]
    g = Tensor(xp.asarray(rng.standard_normal((B, T, args.ffn)).astype(np.float32)), requires_grad=True)
    u = Tensor(xp.asarray(rng.standard_normal((B, T, args.ffn)).astype(np.float32)), requires_grad=True)

    def run(f, *leaves):
        def step():
            for t in leaves:
                t.grad = None
            f().sum().backward()
            _sync(dev)
        return step

    def rotate_half(a):
        return F.cat([-a[..., D // 2:], a[..., :D // 2]], -1)

    ops = {
        "rms_norm fused": run(lambda: F.rms_norm(x, args.width, w, 1e-5), x, w),
        "rms_norm composed": run(lambda: x * ((x * x).mean(-1, keepdim=True) + 1e-5).rsqrt() * w, x, w),
        "rotary fused": run(lambda: F.apply_rotary_emb(q, cos, sin), q),
        "rotary composed": run(lambda: q * Tensor(cos) + rotate_half(q) * Tensor(sin), q),
        "swiglu fused": run(lambda: F.swiglu(g, u), g, u),
        "swiglu composed": run(lambda: F.silu(g) * u, g, u),
    }
    _table(ops, args.repeats, f"the block's ops, forward + backward, float32, {dev}: (batch {B}, {T} tokens, "
                              f"width {args.width} / {H} heads of {D} / ffn {args.ffn})", pairs=True)


def _table(steps, repeats, title, pairs=False):
    for f in steps.values():
        f()                                    # warm up (allocations, BLAS, CUDA kernels)
    times = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    for _ in range(repeats):                  # interleaved: the load on the machine hits every side alike
        for k, f in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            f()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    print(f"\n{title}; {repeats} interleaved repeats, load average {os.getloadavg()[0]:.1f}")
    names = list(steps)
    first = {k: names[0] for k in names}
    if pairs:   # each fused op against the composed one after it
        first = {k: names[i - i % 2] for i, k in enumerate(names)}
    print(f"{'':28s} {'min ms':>10s} {'median ms':>10s} {'ratio':>8s} {'CPU ms':>10s} {'CPU ratio':>10s}")
    for k in names:
        v, c = sorted(times[k]), sorted(cpu[k])
        ratio = min(times[first[k]]) / v[0]
        cmed = float(np.median(c))
        cratio = float(np.median(cpu[first[k]])) / cmed
        print(f"{k:28s} {1e3 * v[0]:10.2f} {1e3 * v[len(v) // 2]:10.2f} {ratio:8.2f} {1e3 * cmed:10.2f} {cratio:10.2f}")
    print("ratio: the first row of each group's time / this row's (below 1: the first row is faster); CPU: "
          "process time, median (one thread each: steadier than wall time on a shared machine)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    import torch
    import transformers
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    else:
        check_gpu(torch, transformers)
    bench_step(args, torch, transformers)
    bench_ops(args)


if __name__ == "__main__":
    main()
