"""``bench/gpu.py --cpu``: the host side of the GPT step on this CPU: eager, replayed (``axonmpi.compile``) and
PyTorch eager in one invocation, interleaved step by step; host ms and kernels (array operations) per step."""
from __future__ import annotations

import time

import numpy as np

__all__ = ["cpu_bench"]


def _axonmpi_step(a, seed=0):
    import axonmpi
    from axonmpi.models import GPT, GPTConfig
    from axonmpi.optim import AdamW, clip_grad_norm_
    axonmpi.manual_seed(seed)
    cfg = GPTConfig(vocab_size=a.vocab, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head,
                    n_embd=a.n_embd, tie_word_embeddings=True)
    model = GPT(cfg, dtype=np.float64 if a.precision == "fp64" else np.float32)
    opt = AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def step(x, y):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss
    return model, opt, step


def _torch_step(a):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=a.vocab, n_positions=a.block_size, n_embd=a.n_embd, n_layer=a.n_layer,
                     n_head=a.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
        kind = "fused AdamW"
    except Exception:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        kind = "AdamW"

    def step(x, y):
        opt.zero_grad()
        out = model(x, labels=y)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return out.loss
    return step, kind


def _torch_ops(step, x, y) -> int:
    """ATen ops one torch step dispatches (the kernels it launches on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    with Count():
        step(x, y)
    return Count.n


def _count(model, opt, step, x, y) -> int:
    """Array operations of one step.  The optimizer's host chunking (cache-sized pieces of a large parameter, a
    host-only choice: a GPU updates it in one piece) is off while counting, so the count is a GPU's."""
    from axonmpi.graphs.count import CountedArray, counting
    from axonmpi.optim import optimizer as O
    chunk, O._HOST_CHUNK = O._HOST_CHUNK, 1 << 62
    try:
        with counting(model, opt) as c:
            step(x.view(CountedArray), y.view(CountedArray))        # the first counted step: arrays become views
            c.reset()
            step(x.view(CountedArray), y.view(CountedArray))
            return c.total
    finally:
        O._HOST_CHUNK = chunk


def _timed(fn, *args):
    t0, c0 = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - t0, time.process_time() - c0


def cpu_bench(a) -> int:
    import os
    import axonmpi
    rng = np.random.default_rng(1)
    batches = [(rng.integers(0, a.vocab, (a.batch, a.block_size)), rng.integers(0, a.vocab, (a.batch, a.block_size)))
               for _ in range(4)]
    _m1, _o1, eager = _axonmpi_step(a)
    _m2, _o2, raw = _axonmpi_step(a)
    replay = axonmpi.compile(raw)
    sides = {"axonmpi eager": eager, "axonmpi replay": replay}
    torch_kind = None
    if not a.no_torch:
        try:
            import torch
            tstep, torch_kind = _torch_step(a)
            tb = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
            sides["torch eager"] = tstep
        except ImportError as e:
            print(f"(no PyTorch column: {e})")
    data = {k: (tb if k == "torch eager" else batches) for k in sides}
    if a.count_only:
        a.steps, a.warmup = 1, 2
    for i in range(max(a.warmup, 2)):
        for k, f in sides.items():
            f(*data[k][i % 4])
    wall = {k: [] for k in sides}
    cpu = {k: [] for k in sides}
    for i in range(a.steps):
        for k, f in (sides.items() if i % 2 == 0 else reversed(list(sides.items()))):
            w, c = _timed(f, *data[k][i % 4])
            wall[k].append(w)
            cpu[k].append(c)
    assert replay.reason is None, replay.reason
    kernels = {"axonmpi eager": _count(_m1, _o1, eager, *batches[0]),
               "axonmpi replay": _count(_m2, _o2, replay, *batches[0])}
    if "torch eager" in sides:
        kernels["torch eager"] = _torch_ops(sides["torch eager"], *tb[0])
    params = sum(p.data.size for p in _m1.parameters())
    ref = "torch eager" if "torch eager" in sides else "axonmpi eager"
    print(f"GPT {a.n_layer} layers x {a.n_head} heads x {a.n_embd} wide, vocab {a.vocab}, {a.batch} x {a.block_size} "
          f"tokens, {params / 1e6:.2f}M parameters, {a.precision}, AdamW + clipping; one process, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; median of {a.steps} steps, sides "
          f"interleaved{' (--count-only: one step, times not meaningful)' if a.count_only else ''}; torch: "
          f"{torch_kind or 'not run'}; kernels: axonmpi.graphs.count (NumPy path), torch ATen ops")
    print(f"{'':16} {'host ms/step':>12} {'cpu ms/step':>12} {'/ ' + ref:>18} {'kernels/step':>13}")
    base = float(np.median(wall[ref]))
    for k in sides:
        w, c = float(np.median(wall[k])) * 1e3, float(np.median(cpu[k])) * 1e3
        print(f"{k:16} {w:12.2f} {c:12.2f} {w / (base * 1e3):18.2f} {kernels.get(k, float('nan')):13}")
    return 0
