"""The host kernels beside PyTorch's on one core: GEMM libraries, then each elementwise op forward + backward.

GEMM: single-precision GFLOP/s at the GPT's and the tensor-parallel block's shapes for NumPy's BLAS, for
torch (MKL), and, where installed, for MKL's ``cblas_sgemm`` called directly (``pip install mkl``) and for
BLIS (``pip install blis``): the libraries from the package registries that could replace NumPy's.
Kernels: axonmpi's op (forward + backward through autograd) beside torch's at the GPT's shapes.
GEMMs are timed by CPU time (``process_time``: steadier than wall time when other processes share the
cores), interleaved, min of --repeats; the op table by CPU time, interleaved, median of --repeats, with the ratio
per op and the geometric mean. ``AXONMPI_KERNELS=numpy`` times the pure-NumPy path.

    python bench/kernels.py
    python bench/kernels.py --repeats 20 --skip-gemm
    AXONMPI_KERNELS=numpy python bench/kernels.py --skip-gemm --only gelu softmax
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"

import argparse  # noqa: E402
import ctypes  # noqa: E402
import glob  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _race(fns: dict, repeats: int) -> dict:
    for f in fns.values():
        f()
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.process_time()
            f()
            best[k] = min(best[k], time.process_time() - t)
    return best


def _mkl_sgemm():
    """MKL's cblas_sgemm through ctypes, sequential, or None where the ``mkl`` wheel is not installed."""
    venv = os.path.dirname(os.path.dirname(sys.executable))
    libs = sorted(glob.glob(os.path.join(venv, "lib", "libmkl_rt.so*")))
    if not libs:
        return None
    mkl = ctypes.CDLL(libs[0])
    mkl.MKL_Set_Threading_Layer(1)   # MKL_THREADING_SEQUENTIAL
    f = mkl.cblas_sgemm
    f.restype = None
    f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_float, ctypes.c_void_p, ctypes.c_int]

    def mm(a, b, out):
        m, k = a.shape
        n = b.shape[1]
        f(101, 111, 111, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, n, 0.0, out.ctypes.data, n)
    return mm


def gemm(repeats: int, torch) -> None:
    from axonmpi.backend import host_compute
    hc = host_compute()
    mkl = _mkl_sgemm()
    try:
        from blis.py import gemm as blis_gemm
    except ImportError:
        blis_gemm = None
    cols = ["numpy " + hc["blas"].split()[0]] + (["torch"] if torch else []) + (["mkl (ctypes)"] if mkl else []) \
        + (["blis"] if blis_gemm else [])
    print(f"GEMM, float32, 1 thread, GFLOP/s; NumPy's BLAS: {hc['blas']} ({hc['kernels']} kernels); CPU {hc['cpu']}")
    print(f"{'m x k x n':>18} " + " ".join(f"{c:>15}" for c in cols))
    for m, k, n in [(512, 512, 512), (1024, 256, 768), (1024, 256, 1024), (1024, 1024, 256), (256, 1024, 4096),
                    (256, 4096, 1024), (4096, 256, 1024)]:
        a = np.random.rand(m, k).astype(np.float32)
        b = np.random.rand(k, n).astype(np.float32)
        out = np.empty((m, n), np.float32)
        fns = {"numpy": lambda: np.matmul(a, b, out=out)}
        if torch:
            ta, tb, to = torch.from_numpy(a), torch.from_numpy(b), torch.empty(m, n)
            fns["torch"] = lambda: torch.mm(ta, tb, out=to)
        if mkl:
            fns["mkl"] = lambda: mkl(a, b, out)
        if blis_gemm:
            fns["blis"] = lambda: blis_gemm(a, b, out=out)
        best = _race(fns, repeats)
        print(f"{f'{m} x {k} x {n}':>18} " + " ".join(f"{2 * m * n * k / 1e9 / t:>15.1f}" for t in best.values()))


def _race_median(fns: dict, repeats: int) -> dict:
    """Interleaved repeats (one of each op in turn), CPU time, median per op."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.process_time()
            f()
            times[k].append(time.process_time() - t)
    return {k: float(np.median(v)) for k, v in times.items()}


def _op_table(torch):
    """(name, axonmpi fn, input shapes, torch fn, integer-input maker) at the issue's shapes."""
    import axonmpi.nn.functional as F
    from axonmpi.autograd import ops_nn
    tf = torch.nn.functional if torch else None
    e = (1024, 1024)
    idx = np.random.default_rng(1).integers(0, 512, 1024)
    tgt = np.random.default_rng(2).integers(0, 512, 1024)
    ops = [
        ("gelu exact (erf)", F.gelu, [e], lambda x: tf.gelu(x)),
        ("gelu tanh", lambda x: F.gelu(x, "tanh"), [e], lambda x: tf.gelu(x, approximate="tanh")),
        ("silu", F.silu, [e], lambda x: tf.silu(x)),
        ("swiglu silu(a) * b", F.swiglu, [e, e], lambda a, b: tf.silu(a) * b),
        ("relu", F.relu, [e], lambda x: tf.relu(x)),
        ("sigmoid", F.sigmoid, [e], lambda x: torch.sigmoid(x)),
        ("tanh", F.tanh, [e], lambda x: torch.tanh(x)),
        ("exp", F.exp, [e], lambda x: torch.exp(x)),
        ("mul-add x * y + z", lambda x, y, z: x * y + z, [e, e, e], lambda x, y, z: x * y + z),
        ("embedding 512 x 256, 1024 ids", lambda w: F.embedding(idx, w), [(512, 256)],
         lambda w: tf.embedding(torch.from_numpy(idx), w)),
        ("softmax (1024, 512)", lambda x: F.softmax(x, -1), [(1024, 512)], lambda x: torch.softmax(x, -1)),
        ("log_softmax (1024, 512)", lambda x: F.log_softmax(x, -1), [(1024, 512)],
         lambda x: torch.log_softmax(x, -1)),
        ("cross_entropy (1024, 512)", lambda x: F.cross_entropy(x, tgt), [(1024, 512)],
         lambda x: tf.cross_entropy(x, torch.from_numpy(tgt))),
        ("layer_norm (8, 128, 256)", lambda x, w, b: F.layer_norm(x, 256, w, b), [(8, 128, 256), (256,), (256,)],
         lambda x, w, b: tf.layer_norm(x, (256,), w, b)),
        ("rms_norm (8, 128, 256)", lambda x, w: F.rms_norm(x, 256, w, eps=1e-6), [(8, 128, 256), (256,)],
         lambda x, w: tf.rms_norm(x, (256,), w, eps=1e-6)),
        ("mean", lambda x: x.mean(), [e], lambda x: x.mean()),
        ("matmul (1024, 1024) @ (1024, 1024)", lambda a, b: a @ b, [e, e], lambda a, b: a @ b),
        ("linear 256 -> 1024, 1024 rows", F.linear, [(1024, 256), (1024, 256), (1024,)],
         tf.linear if tf else None),
        ("causal sdpa (8, 4, 128, 64)", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
         [(8, 4, 128, 64)] * 3, lambda q, k, v: tf.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("dropout p=0.1", lambda x: F.dropout(x, 0.1), [e], lambda x: tf.dropout(x, 0.1)),
        ("residual + dropout p=0.1", lambda x, r: F.dropout_add(x, r, 0.1), [e, e], lambda x, r: r + tf.dropout(x, 0.1)),
        ("gqa causal (4, 8/2 heads, 128, 32)", lambda q, k, v: ops_nn.grouped_causal_attention(q, k, v, 4),
         [(4, 2, 512, 32), (4, 2, 128, 32), (4, 2, 128, 32)],
         lambda q, k, v: tf.scaled_dot_product_attention(q.reshape(4, 8, 128, 32), k, v, is_causal=True,
                                                         enable_gqa=True).reshape(4, 2, 512, 32)),
    ]
    return ops


def kernels(repeats: int, torch, only=None) -> None:
    from axonmpi import Tensor, kernels as K
    rng = np.random.default_rng(0)
    print(f"\nkernels, forward + backward through autograd, float32, 1 thread, CPU ms (median of {repeats} interleaved); "
          f"host path: {K.host_path()}")
    print(f"{'op and shape':<40}{'axonmpi':>9}{'torch':>9}{'ratio':>7}")
    ratios = []
    for name, ours_fn, shapes, torch_fn in _op_table(torch):
        if only and not any(o in name for o in only):
            continue
        arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        ours_in = [Tensor(a, requires_grad=True) for a in arrays]
        out = ours_fn(*ours_in)
        g = Tensor(rng.standard_normal(out.shape).astype(np.float32))

        def ours():
            for t in ours_in:
                t.grad = None
            ours_fn(*ours_in).backward(g)
        fns = {"ours": ours}
        if torch:
            t_in = [torch.tensor(a, requires_grad=True) for a in arrays]
            tg = torch.from_numpy(g.data)

            def theirs():
                for t in t_in:
                    t.grad = None
                torch_fn(*t_in).backward(tg)
            fns["torch"] = theirs
        best = _race_median(fns, repeats)
        tt = best.get("torch")
        if tt:
            ratios.append(best["ours"] / tt)
        print(f"{name:<40}{1e3 * best['ours']:>9.2f}" + (f"{1e3 * tt:>9.2f}{best['ours'] / tt:>7.2f}" if tt else ""))
    if ratios:
        gm = float(np.exp(np.mean(np.log(ratios))))
        print(f"{'geometric mean over ' + str(len(ratios)) + ' ops':<58}{gm:>7.2f}   (worst {max(ratios):.2f})")


def _gpt_shapes():
    """The parameter shapes of bench/vs_torch.py's GPT (4 layers x 256, vocab 96, 128 positions): 3.2 M."""
    c = 256
    shapes = [(96, c), (128, c)]
    for _ in range(4):
        shapes += [(c,), (c,), (3 * c, c), (3 * c,), (c, c), (c,), (c,), (c,), (4 * c, c), (4 * c,), (c, 4 * c), (c,)]
    return shapes + [(c,), (c,)]


def optimizer(repeats: int, torch) -> None:
    """AdamW's step and the gradient clip over the GPT's parameters, beside torch's (its defaults: foreach)."""
    from axonmpi import Tensor
    from axonmpi.nn import Parameter
    from axonmpi.optim import AdamW, clip_grad_norm_, clip_grad_norm_array_
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in _gpt_shapes()]
    grads = [rng.standard_normal(s).astype(np.float32) * 1e-3 for s in _gpt_shapes()]
    ours = [Parameter(a.copy()) for a in arrays]
    for p, g in zip(ours, grads):
        p.grad = Tensor(g.copy())
    opt = AdamW(ours, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    fns = {"ours adamw": opt.step, "ours clip": lambda: clip_grad_norm_(ours, 1e9),
           "ours clip (array, no host sync)": lambda: clip_grad_norm_array_(ours, 1e9)}
    if torch:
        theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
        for p, g in zip(theirs, grads):
            p.grad = torch.from_numpy(g.copy())
        topt = torch.optim.AdamW(theirs, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
        fns.update({"torch adamw": topt.step,
                    "torch clip": lambda: torch.nn.utils.clip_grad_norm_(theirs, 1e9)})
    best = _race_median(fns, repeats)
    n = sum(a.size for a in arrays)
    print(f"\noptimizer over the GPT's {len(arrays)} parameters ({n / 1e6:.1f} M), float32, CPU ms (median of {repeats})")
    print(f"{'op':<40}{'axonmpi':>9}{'torch':>9}{'ratio':>7}")
    for name, ours_k, torch_k in (("AdamW step", "ours adamw", "torch adamw"), ("clip_grad_norm_", "ours clip", "torch clip"),
                                  ("clip_grad_norm_array_ (no host sync)", "ours clip (array, no host sync)", "torch clip")):
        tt = best.get(torch_k)
        print(f"{name:<40}{1e3 * best[ours_k]:>9.2f}" + (f"{1e3 * tt:>9.2f}{best[ours_k] / tt:>7.2f}" if tt else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--skip-gemm", action="store_true")
    ap.add_argument("--only", nargs="*", help="ops whose name contains one of these words")
    args = ap.parse_args()
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        torch = None
        print("torch not installed: its columns are skipped (pip install torch==2.13.0)")
    if not args.skip_gemm:
        gemm(args.repeats, torch)
    kernels(args.repeats, torch, args.only)
    if not args.only:
        optimizer(args.repeats, torch)


if __name__ == "__main__":
    main()
