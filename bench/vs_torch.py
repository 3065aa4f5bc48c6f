"""Every strategy side by side with PyTorch (CPU, gloo) in one invocation: step times and ratios.

For each case and each world size in --ranks (default 1 2 4) this starts --repeats times
``mpiexec -n N python bench/vs_torch.py --worker --case C``. Every rank builds both sides, axonmpi's
(over MPI) and PyTorch's (over gloo, TCP on 127.0.0.1), and runs their steps alternately (axonmpi,
torch, torch, axonmpi, ...), so load from other processes on the machine falls on both alike; one
BLAS/OpenMP thread per rank. Each side has two warm-up steps, then --steps timed steps, each between two
barriers (a step is the slowest rank's). The table gives the min and the median over every timed
step of every run, the ratio axonmpi / torch of each (below 1: axonmpi is faster) and the median of
the ratios of steps that ran next to each other ("pairs": load that changes slowly cancels); one-rank
rows also give the ratio of CPU time (``process_time``, steadier than wall time when other processes share
the cores). ``uptime``'s load average is printed before and after.

| case | axonmpi | PyTorch 2.13 |
|---|---|---|
| ``gpt1`` | ``models.GPT`` 4 layers x 4 heads x 256, vocab 96, 8 x 128 tokens, AdamW, 1 process | ``transformers.GPT2LMHeadModel`` of the same shape (dropout 0, untied) |
| ``tp`` | Megatron MLP block 1024 -> 4096 -> 1024 (tanh GELU), 256 tokens, SGD: ``parallelize(tensor_parallel={"0": "column", "2": "row"})`` | DTensor ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` |
| ``tp_sp`` | the block with a LayerNorm and a residual, sequence parallel (``sequence_parallel=True``) | ``SequenceParallel`` LayerNorm, ``ColwiseParallel(input_layouts=Shard(0))``, ``RowwiseParallel(output_layouts=Shard(0))`` |
| ``ddp`` | MLP 784 -> 1024 -> 1024 -> 10, 128 samples per rank, Adam: ``parallelize`` (DDP) | ``DistributedDataParallel`` |
| ``fsdp`` | the same MLP, ``parallelize(data_parallel="fsdp")`` (full shard) | FSDP2 ``fully_shard`` per Linear and the root |
| ``pp_1f1b`` / ``pp_zbh1`` | 8 layers (Linear 512 + tanh), 256 samples in 8 micro-batches, ``PipelinePlan(8, "1f1b" / "zb-h1")`` | ``torch.distributed.pipelining`` ``Schedule1F1B`` / ``ScheduleInterleavedZeroBubble`` (one stage per rank: ZB-H1) |
| ``cp`` | 2 transformer blocks (width 128, 4 heads), 2 x 1024 tokens, ``context_parallel="ring"`` | none on CPU: torch 2.13's ring attention (``context_parallel``) has no sharding rule for the CPU attention kernel; the column is the formula ``serial torch step / N`` |
| ``moe`` | Linear -> ``nn.MoE`` (4 experts, top-1, hidden 1024) -> Linear, width 256, 512 tokens per rank, ``expert_parallel=N`` | the dense equivalent (one expert's MLP per token) under DDP |
| ``gpt3d`` | the GPT above, global batch 16, at 4 ranks: FSDP over data 2 x Megatron tensor 2 with sequence parallel, ``recipes.HybridGPT`` | the same GPT written in torch on a 2-D mesh: ``fully_shard`` over data, ``parallelize_module`` with sequence parallel over tensor (torchtitan's layout) |

Usage::

    python bench/vs_torch.py                                # every case at 1, 2, 4 ranks (about 20 minutes here)
    python bench/vs_torch.py --cases gpt1 tp --ranks 1 2 --repeats 5
    python bench/vs_torch.py --cases tp --ranks 2 --json out.json

Needs ``pip install torch==2.13.0`` (and ``transformers`` for ``gpt1``; without it ``gpt1`` uses the
torch GPT of ``gpt3d``). Timings are never asserted anywhere; docs/performance.md holds a run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench/ itself off the path: transformers imports the hub's ``kernels`` package, which bench/kernels.py would shadow
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
WARMUP = 2
CASES = ("gpt1", "tp", "tp_sp", "ddp", "fsdp", "pp_1f1b", "pp_zbh1", "cp", "moe", "gpt3d")
RANKS = {"gpt1": (1,), "pp_1f1b": (2, 4), "pp_zbh1": (2, 4), "gpt3d": (4,)}   # the others: any

# shapes
GPT = dict(vocab=96, block=128, batch=8, layers=4, heads=4, width=256)
TP = dict(embed=1024, hidden=4096, tokens=256, lr=1e-5)
MLP = dict(d_in=784, hidden=1024, d_out=10, batch=128)
PP = dict(width=512, layers=8, classes=10, batch=256, micro=8)
CP = dict(width=128, heads=4, blocks=2, seq=1024, batch=2, classes=64)
MOE = dict(width=256, experts=4, hidden=1024, tokens=512, classes=10)


# ---------------------------------------------------------------------------------------------- axonmpi side
def _ours(case: str, n: int):
    """axonmpi's step of ``case`` on ``n`` ranks (this one's part), and the World."""
    import numpy as np

    sys.path.insert(0, ROOT)
    import axonmpi
    import axonmpi.nn as nn
    import axonmpi.nn.functional as F
    from axonmpi import Tensor
    from axonmpi.optim import SGD, Adam, AdamW
    from axonmpi.parallel import PipelinePlan, parallelize

    grid_kw = {"tp": {"G_intra_c": n}, "tp_sp": {"G_intra_c": n}, "pp_1f1b": {"G_inter": n},
               "pp_zbh1": {"G_inter": n}, "cp": {"G_context": n}, "moe": {"expert_parallel": n},
               "gpt3d": {"G_intra_c": 2}}.get(case, {})
    world = axonmpi.init(**grid_kw)
    rng = np.random.default_rng(0)
    axonmpi.manual_seed(0)

    if case == "gpt1":
        from axonmpi.models import GPT as GPTModel, GPTConfig
        g = GPT
        model = GPTModel(GPTConfig(vocab_size=g["vocab"], block_size=g["block"], n_layer=g["layers"],
                                   n_head=g["heads"], n_embd=g["width"]))
        opt = AdamW(model.parameters(), lr=1e-3)
        idx = rng.integers(0, g["vocab"], (g["batch"], g["block"]))
        tgt = rng.integers(0, g["vocab"], (g["batch"], g["block"]))

        def step():
            opt.zero_grad()
            model(idx, tgt)[1].backward()
            opt.step()
    elif case in ("tp", "tp_sp"):
        E, H, T = TP["embed"], TP["hidden"], TP["tokens"]

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln, self.fc, self.act, self.proj = nn.LayerNorm(E), nn.Linear(E, H), nn.GELU("tanh"), nn.Linear(H, E)

            def forward(self, x):
                return x + self.proj(self.act(self.fc(self.ln(x))))

        if case == "tp":
            model = nn.Sequential(nn.Linear(E, H), nn.GELU("tanh"), nn.Linear(H, E))
            plan = {"0": "column", "2": "row"}
        else:
            model, plan = Block(), {"fc": "column", "proj": "row"}
        if n > 1:
            model = parallelize(model, tensor_parallel=plan, data_parallel=None,
                                sequence_parallel=case == "tp_sp", sequence_dim=0)
        opt = SGD(model.parameters(), lr=TP["lr"])
        x = Tensor(rng.standard_normal((T, E)).astype(np.float32))

        def step():
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    elif case in ("ddp", "fsdp"):
        m = MLP
        model = nn.Sequential(nn.Linear(m["d_in"], m["hidden"]), nn.ReLU(), nn.Linear(m["hidden"], m["hidden"]),
                              nn.ReLU(), nn.Linear(m["hidden"], m["d_out"]))
        pm = parallelize(model, data_parallel=case)
        opt = Adam(pm.parameters(), lr=1e-3)
        r = np.random.default_rng(world.rank)
        x = Tensor(r.standard_normal((m["batch"], m["d_in"])).astype(np.float32))
        y = r.integers(0, m["d_out"], m["batch"])

        def step():
            opt.zero_grad()
            F.cross_entropy(pm(x), y).backward()
            opt.step()
    elif case in ("pp_1f1b", "pp_zbh1"):
        p = PP
        W = p["width"]
        layers = [nn.Sequential(nn.Linear(W, W), nn.Tanh()) for _ in range(p["layers"] - 1)]
        layers.append(nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, p["classes"])))
        pm = parallelize(nn.Sequential(*layers), data_parallel=None,
                         pipeline=PipelinePlan(p["micro"], "1f1b" if case == "pp_1f1b" else "zb-h1", split_by="layers"))
        opt = Adam(pm.parameters(), lr=1e-3)
        x = rng.standard_normal((p["batch"], W)).astype(np.float32)
        y = rng.integers(0, p["classes"], p["batch"])
        xb, yb = pm.local_batch(x, y)

        def step():
            opt.zero_grad()
            pm.step(xb, yb)
            opt.step()
    elif case == "cp":
        c = CP
        model = nn.Sequential(*[nn.TransformerBlock(c["width"], c["heads"]) for _ in range(c["blocks"])],
                              nn.LayerNorm(c["width"]), nn.Linear(c["width"], c["classes"]))
        if n > 1:
            model = parallelize(model, context_parallel="ring")
        opt = AdamW(model.parameters(), lr=1e-3)
        x = rng.standard_normal((c["batch"], c["seq"], c["width"])).astype(np.float32)
        y = rng.integers(0, c["classes"], (c["batch"], c["seq"]))
        xb, yb = model.local_batch(x, y) if n > 1 else (x, y)
        xb = Tensor(np.ascontiguousarray(xb))

        def step():
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    elif case == "moe":
        c = MOE
        model = nn.Sequential(nn.Linear(c["width"], c["width"]),
                              nn.MoE(c["width"], c["experts"], top_k=1, hidden=c["hidden"]),
                              nn.Linear(c["width"], c["classes"]))
        pm = parallelize(model, expert_parallel=n)
        opt = Adam(pm.parameters(), lr=1e-3)
        x = rng.standard_normal((c["tokens"] * n, c["width"])).astype(np.float32)
        y = rng.integers(0, c["classes"], c["tokens"] * n)
        xb, yb = pm.local_batch(x, y)
        xb = Tensor(np.ascontiguousarray(xb))

        def step():
            opt.zero_grad()
            loss = F.cross_entropy(pm(xb), yb)
            aux, z = nn.moe_losses(pm.inner)
            (loss + 1e-2 * aux + 1e-3 * z).backward()
            opt.step()
    elif case == "gpt3d":
        from axonmpi.models import GPTConfig
        from axonmpi.recipes import HybridGPT
        g = GPT
        cfg = GPTConfig(vocab_size=g["vocab"], block_size=g["block"], n_layer=g["layers"], n_head=g["heads"],
                        n_embd=g["width"])
        hyb = HybridGPT(cfg, world.grid, tp_style="megatron", sequence_parallel=True, fsdp="full_shard",
                        global_batch=2 * g["batch"])
        opt = AdamW(hyb.parameters(), lr=1e-3)
        idx = rng.integers(0, g["vocab"], (2 * g["batch"], g["block"]))
        tgt = rng.integers(0, g["vocab"], (2 * g["batch"], g["block"]))
        xb, yb = hyb.local_batch(idx), hyb.local_batch(tgt)

        def step():
            opt.zero_grad()
            hyb.forward_backward(xb, yb)
            opt.step()
    else:
        raise ValueError(f"unknown case {case!r}; expected one of {CASES}")
    return step, world


# ---------------------------------------------------------------------------------------------- torch side
def _torch_gpt(torch, V, T, L, H, C):
    """GPT-2 in plain torch with separate q / k / v projections (so a DTensor plan splits heads)."""
    nnt, F = torch.nn, torch.nn.functional

    class Attn(nnt.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.proj = (nnt.Linear(C, C) for _ in range(4))

        def forward(self, x):
            B, t, _ = x.shape
            q, k, v = (m(x) for m in (self.q, self.k, self.v))
            hd = C // H
            nh = q.shape[-1] // hd                    # the local heads under tensor parallelism
            q, k, v = (a.view(B, t, nh, hd).transpose(1, 2) for a in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(B, t, nh * hd))

    class Block(nnt.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = nnt.LayerNorm(C), Attn(), nnt.LayerNorm(C)
            self.fc, self.act, self.mproj = nnt.Linear(C, 4 * C), nnt.GELU("tanh"), nnt.Linear(4 * C, C)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mproj(self.act(self.fc(self.ln_2(x))))

    class Model(nnt.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nnt.Embedding(V, C), nnt.Embedding(T, C)
            self.blocks = nnt.ModuleList(Block() for _ in range(L))
            self.ln_f, self.head = nnt.LayerNorm(C), nnt.Linear(C, V, bias=False)

        def forward(self, idx, tgt):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1])[None])
            for b in self.blocks:
                x = b(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))

    return Model()


def _torch(case: str, n: int, port: int, rank: int):
    """PyTorch's step of ``case`` on ``n`` ranks (gloo over TCP on 127.0.0.1), this rank's part."""
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    from torch.distributed.device_mesh import init_device_mesh
    nnt, F = torch.nn, torch.nn.functional
    torch.manual_seed(0)
    rng = np.random.default_rng(0)

    if case == "gpt1":
        g = GPT
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
            from transformers.utils import logging as hf_logging
            hf_logging.set_verbosity_error()
            cfg = GPT2Config(vocab_size=g["vocab"], n_positions=g["block"], n_embd=g["width"], n_layer=g["layers"],
                             n_head=g["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
            hf = GPT2LMHeadModel(cfg)
            model = lambda i, t: hf(input_ids=i, labels=t).loss   # noqa: E731 (shifted labels: one token fewer)
            params = hf.parameters()
        except ImportError:
            tm = _torch_gpt(torch, g["vocab"], g["block"], g["layers"], g["heads"], g["width"])
            model, params = tm, tm.parameters()
        opt = torch.optim.AdamW(params, lr=1e-3)
        idx = torch.from_numpy(rng.integers(0, g["vocab"], (g["batch"], g["block"])))
        tgt = torch.from_numpy(rng.integers(0, g["vocab"], (g["batch"], g["block"])))

        def step():
            opt.zero_grad()
            model(idx, tgt).backward()
            opt.step()
    elif case in ("tp", "tp_sp"):
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                       parallelize_module)
        E, H, T = TP["embed"], TP["hidden"], TP["tokens"]

        class Block(nnt.Module):
            def __init__(self):
                super().__init__()
                self.ln, self.fc, self.act, self.proj = nnt.LayerNorm(E), nnt.Linear(E, H), nnt.GELU("tanh"), nnt.Linear(H, E)

            def forward(self, x):
                return x + self.proj(self.act(self.fc(self.ln(x))))

        x = torch.from_numpy(rng.standard_normal((T, E)).astype(np.float32))
        if case == "tp":
            model = nnt.Sequential(nnt.Linear(E, H), nnt.GELU("tanh"), nnt.Linear(H, E))
            if n > 1:
                parallelize_module(model, init_device_mesh("cpu", (n,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        else:
            model = Block()
            if n > 1:
                parallelize_module(model, init_device_mesh("cpu", (n,)), {
                    "ln": SequenceParallel(sequence_dim=0), "fc": ColwiseParallel(input_layouts=Shard(0)),
                    "proj": RowwiseParallel(output_layouts=Shard(0))})
                x = x.chunk(n, dim=0)[rank].contiguous()   # this rank's tokens (as axonmpi's pm keeps)
        opt = torch.optim.SGD(model.parameters(), lr=TP["lr"])

        def step():
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    elif case in ("ddp", "fsdp", "moe"):
        if case == "moe":
            c = MOE
            model = nnt.Sequential(nnt.Linear(c["width"], c["width"]), nnt.Linear(c["width"], c["hidden"]),
                                   nnt.GELU("tanh"), nnt.Linear(c["hidden"], c["width"]),
                                   nnt.Linear(c["width"], c["classes"]))
            b, d_in, d_out = c["tokens"], c["width"], c["classes"]
        else:
            m = MLP
            model = nnt.Sequential(nnt.Linear(m["d_in"], m["hidden"]), nnt.ReLU(), nnt.Linear(m["hidden"], m["hidden"]),
                                   nnt.ReLU(), nnt.Linear(m["hidden"], m["d_out"]))
            b, d_in, d_out = m["batch"], m["d_in"], m["d_out"]
        if case == "fsdp":
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (n,))
            for layer in model:
                if isinstance(layer, nnt.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            model = nnt.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        r = np.random.default_rng(rank)
        x = torch.from_numpy(r.standard_normal((b, d_in)).astype(np.float32))
        y = torch.from_numpy(r.integers(0, d_out, b))

        def step():
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    elif case in ("pp_1f1b", "pp_zbh1"):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble
        p = PP
        W = p["width"]
        layers = [nnt.Sequential(nnt.Linear(W, W), nnt.Tanh()) for _ in range(p["layers"] - 1)]
        layers.append(nnt.Sequential(nnt.Linear(W, W), nnt.Tanh(), nnt.Linear(W, p["classes"])))
        k = p["layers"] // n
        stage_mod = nnt.Sequential(*layers[rank * k:(rank + 1) * k])
        stage = PipelineStage(stage_mod, rank, n, torch.device("cpu"))
        if case == "pp_1f1b":
            sched = Schedule1F1B(stage, n_microbatches=p["micro"], loss_fn=F.cross_entropy)
        else:
            sched = ScheduleInterleavedZeroBubble([stage], n_microbatches=p["micro"], loss_fn=F.cross_entropy)
        opt = torch.optim.Adam(stage_mod.parameters(), lr=1e-3)
        x = torch.from_numpy(rng.standard_normal((p["batch"], W)).astype(np.float32))
        y = torch.from_numpy(rng.integers(0, p["classes"], p["batch"]))

        def step():
            opt.zero_grad()
            if rank == 0:
                sched.step(x)
            elif rank == n - 1:
                sched.step(target=y)
            else:
                sched.step()
            opt.step()
    elif case == "cp":
        # torch 2.13's context_parallel has no sharding rule for the CPU attention kernel
        # (aten._scaled_dot_product_flash_attention_for_cpu): time the serial model on rank 0; _worker divides by N
        c = CP
        C, Hh = c["width"], c["heads"]

        class Block(nnt.Module):
            def __init__(self):
                super().__init__()
                self.ln_1, self.qkv, self.proj = nnt.LayerNorm(C), nnt.Linear(C, 3 * C), nnt.Linear(C, C)
                self.ln_2, self.fc, self.act, self.mproj = nnt.LayerNorm(C), nnt.Linear(C, 4 * C), nnt.GELU("tanh"), nnt.Linear(4 * C, C)

            def forward(self, x):
                B, t, _ = x.shape
                q, k, v = (a.view(B, t, Hh, C // Hh).transpose(1, 2) for a in self.qkv(self.ln_1(x)).split(C, dim=2))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, t, C)
                x = x + self.proj(y)
                return x + self.mproj(self.act(self.fc(self.ln_2(x))))

        model = nnt.Sequential(*[Block() for _ in range(c["blocks"])], nnt.LayerNorm(C), nnt.Linear(C, c["classes"]))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.from_numpy(rng.standard_normal((c["batch"], c["seq"], C)).astype(np.float32))
        y = torch.from_numpy(rng.integers(0, c["classes"], (c["batch"], c["seq"])))

        def step():
            opt.zero_grad()
            F.cross_entropy(model(x).reshape(-1, c["classes"]), y.reshape(-1)).backward()
            opt.step()
    elif case == "gpt3d":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)
        g = GPT
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = _torch_gpt(torch, g["vocab"], g["block"], g["layers"], g["heads"], g["width"])
        tp = mesh["tp"]
        parallelize_module(model, tp, {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
        for b in model.blocks:
            parallelize_module(b, tp, {
                "ln_1": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                "ln_2": SequenceParallel(),
                "fc": ColwiseParallel(input_layouts=Shard(1)),
                "mproj": RowwiseParallel(output_layouts=Shard(1)),
            })
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dp_rank = mesh["dp"].get_local_rank()
        r = np.random.default_rng(0)
        idx = r.integers(0, g["vocab"], (2 * g["batch"], g["block"]))
        tgt = r.integers(0, g["vocab"], (2 * g["batch"], g["block"]))
        sl = slice(dp_rank * g["batch"], (dp_rank + 1) * g["batch"])
        idx, tgt = torch.from_numpy(idx[sl]), torch.from_numpy(tgt[sl])

        def step():
            opt.zero_grad()
            model(idx, tgt).backward()
            opt.step()
    else:
        raise ValueError(f"unknown case {case!r}; expected one of {CASES}")
    return step


def _worker(case: str, n: int, steps: int, port: int) -> None:
    """Both sides in this process, their steps alternating (so load from elsewhere falls on both alike)."""
    ours, world = _ours(case, n)
    formula = case == "cp" and n > 1      # torch: the serial model on rank 0, its time / n
    theirs = _torch(case, 1 if formula else n, port, 0 if formula else world.rank) \
        if not formula or world.rank == 0 else (lambda: None)
    times = {"ours": [], "torch": [], "ours_cpu": [], "torch_cpu": []}
    for _ in range(WARMUP):
        ours()
        theirs()
    for i in range(steps):
        for side in (("ours", "torch") if i % 2 == 0 else ("torch", "ours")):
            f = ours if side == "ours" else theirs
            world.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            f()
            world.barrier()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if side == "torch" and formula:
                wall, cpu = wall / n, cpu / n
            times[side].append(wall)
            times[side + "_cpu"].append(cpu)
    if world.rank == 0:
        print("RESULT" + json.dumps(times), flush=True)


# ---------------------------------------------------------------------------------------------- driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(case: str, n: int, steps: int, timeout: float):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker", "--case", case,
           "--n", str(n), "--steps", str(steps), "--port", str(_free_port())]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    if out.returncode or not lines:
        tail = (out.stderr or out.stdout).strip().splitlines()[-6:]
        return None, " | ".join(tail)[-600:]
    return json.loads(lines[0][6:]), None


def _uptime() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def _median(v):
    v = sorted(v)
    return 0.5 * (v[(len(v) - 1) // 2] + v[len(v) // 2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=2, help="runs (launches) of each case")
    ap.add_argument("--steps", type=int, default=6, help="timed steps of each side per run (after 2 warm-up steps)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29500, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.case, args.n, args.steps, args.port)
        return
    try:
        import torch
        tv = torch.__version__
    except ImportError:
        sys.exit("torch is not installed: pip install torch==2.13.0 (the CPU wheel); transformers for gpt1")
    load0 = _uptime()
    print(f"axonmpi vs PyTorch {tv}, 1 BLAS/OpenMP thread per rank, {os.cpu_count()} CPUs, "
          f"{args.repeats} runs x {args.steps} steps of each side, alternating; load average {load0}", flush=True)
    print(f"{'case':<9} {'ranks':>5} | {'axonmpi ms min':>14} {'median':>8} | {'torch ms min':>12} {'median':>8} | "
          f"{'ratio min':>9} {'median':>7} {'pairs':>7}", flush=True)
    rows = []
    for case in args.cases:
        for n in args.ranks:
            if n not in RANKS.get(case, (1, 2, 4)) or (case == "moe" and MOE["experts"] % n):
                continue
            t = {"ours": [], "torch": [], "ours_cpu": [], "torch_cpu": []}
            errors = []
            for _ in range(args.repeats):
                res, err = _launch(case, n, args.steps, args.timeout)
                if res is None:
                    errors.append(err)
                    continue
                for k in t:
                    t[k] += res[k]
            nan = math.nan
            row = {"case": case, "ranks": n, "load": _uptime(), "errors": errors,
                   "torch_column": "serial torch / N (formula)" if case == "cp" and n > 1 else "measured"}
            for k, v in t.items():
                row[k + "_min"], row[k + "_median"] = (min(v), _median(v)) if v else (nan, nan)
            # step i of each side ran next to each other: their ratio cancels load that changes slowly
            pairs = [a / b for a, b in zip(t["ours"], t["torch"])]
            row["pair_ratio_median"] = _median(pairs) if pairs else nan
            row["steps"] = t
            rows.append(row)
            note = "  torch: serial / N (formula)" if case == "cp" and n > 1 else ""
            cpu = (f" | cpu median {row['ours_cpu_median'] / row['torch_cpu_median']:.2f}x" if n == 1 else "")
            print(f"{case:<9} {n:>5} | {1e3 * row['ours_min']:>14.1f} {1e3 * row['ours_median']:>8.1f} | "
                  f"{1e3 * row['torch_min']:>12.1f} {1e3 * row['torch_median']:>8.1f} | "
                  f"{row['ours_min'] / row['torch_min']:>8.2f}x {row['ours_median'] / row['torch_median']:>6.2f}x "
                  f"{row['pair_ratio_median']:>6.2f}x{cpu}{note}", flush=True)
            for e in errors[:2]:
                print(f"    error: {e}", flush=True)
    print(f"load average before {load0}, after {_uptime()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
