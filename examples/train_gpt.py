"""Train a GPT (or a Llama) over MPI ranks: by default character-level on the Python standard library's own source
(download-free); on your token files with --data; from Hugging Face weights with --init-from hf:DIR.

Run on 4 local ranks (what `make demo` does; after `make install` the tools are in .venv/bin):

    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_gpt.py
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_gpt.py --resume     # continue from the last checkpoint
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_gpt.py --layout "tp=2,pp=2,dp=1"   # as `axonmpi plan` prints
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_gpt.py --G-inter 2 --G-intra-c 2   # pipeline x AxoNN tensor
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_gpt.py --context-parallel 2 --cp-algo ring
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_gpt.py --model llama --n-kv-head 1 --tp 4 \
        --sequence-parallel --checkpoint-dir checkpoints/llama   # a Llama: its key/value head on every tensor rank
    .venv/bin/python examples/prepare_data.py input.txt --out data/mine           # your text -> token files
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train_gpt.py --data data/mine --init-from hf:gpt2-dir \
        --layout "tp=2,pp=2,dp=1" --checkpoint-dir runs/ft    # fine-tune (docs/finetune.md); ckpt export --format hf-gpt2

`tp` means Megatron tensor parallelism everywhere (--tp, --layout, `axonmpi plan`); AxoNN's 3-D split is
--G-intra-r/c/d with --tp-style axonn. A flag that does nothing in the chosen layout is refused.

--model llama trains axonmpi.models.Llama (RMSNorm, rotary positions, grouped-query attention with --n-kv-head
key/value heads, a SwiGLU MLP of --ffn-hidden) through the same recipe (axonmpi.recipes.llama; docs/llama.md):
every layout flag below applies, and its checkpoints export with axonmpi ckpt export --format hf-llama.

By default each rank holds the whole model (DistributedDataParallel); the global batch is split
across ranks, gradients are averaged with bucketed all-reduces overlapped with backward. The
five AxoNN sizes (--G-data, --G-inter, --G-intra-r, --G-intra-c, --G-intra-d) lay the ranks out
as data x pipeline x tensor parallel (axonmpi.recipes.gpt; docs/hybrid.md); the loss printed
is the mean over the whole global batch under every layout, and checkpoints load under any other
layout: each log line and the final summary show the step's loss (the global batch's mean, what
one process on the whole batch computes) beside its moving average (EMA 0.9, over this run's steps:
after a --resume it starts again from the first resumed step, as the log says), labelled. Rank 0
shows a progress bar (loss, loss_ema, tokens/s, ETA) when its stderr reaches a terminal, also
through mpiexec (--progress / --no-progress force it), evaluates on held-out text, prints a generated
sample, and a sharded HDF5 checkpoint is written at the end (and every --save-every steps). Every log line, the bar
and --metrics-json carry step time, tokens/s (this step's and averaged), MFU (with --peak-tflops or a detected GPU),
peak memory, the data position and the time; the run folder (--checkpoint-dir) keeps train.log and metrics.jsonl.

SIGTERM or SIGUSR1 (what Slurm sends before a time limit or a preemption; jobs/*.sbatch ask for
SIGUSR1 120 s ahead) makes every rank stop at the next step boundary, save, and exit with code 75,
on which the job templates requeue the job; the requeued job's --auto-resume continues.
"""
import argparse
import atexit
import dataclasses
import datetime
import functools
import json
import logging
import math
import os
import resource
import sys
import time
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import axonmpi  # noqa: E402
from axonmpi import checkpoint as ckpt  # noqa: E402
from axonmpi.data import (CharDataset, CharTokenizer, TokenFileDataset, load_stdlib_corpus, read_token_meta,  # noqa: E402
                          token_files, unigram_entropy)
from axonmpi.data.tokens import open_tokens  # noqa: E402
from axonmpi.models import GPTConfig, LlamaConfig  # noqa: E402
from axonmpi.models.gpt import padded_vocab_size  # noqa: E402
from axonmpi.optim import AdamW, ZeroRedundancyOptimizer  # noqa: E402
from axonmpi.amp import GradScaler  # noqa: E402
from axonmpi.finite import check_finite  # noqa: E402
from axonmpi.parallel.fsdp import MixedPrecision  # noqa: E402
from axonmpi.recipes import HybridGPT, Layout, check_layout  # noqa: E402
from axonmpi.optim.lr_scheduler import LinearWarmupCosine  # noqa: E402


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default shown."""


# options that fix the model's shapes (or its vocabulary): a resume must use the saved values
ARCH_OPTIONS = ("model", "n_layer", "n_head", "n_embd", "block_size", "corpus_bytes", "dtype", "moe_experts", "moe_top_k",
                "moe_every", "tie_word_embeddings", "make_vocab_size_divisible_by", "n_kv_head", "ffn_hidden",
                "rope_theta", "vocab_rows")
# the flags only one model family reads
LLAMA_ONLY = ("n_kv_head", "ffn_hidden", "rope_theta")
# training options a --resume may change: applied from the resumed step on, one log line each (old -> new)
APPLIED_ON_RESUME = ("lr", "warmup", "weight_decay", "grad_clip", "dropout", "global_batch")
# training options a --resume cannot change honestly: refused, naming them
FIXED_ON_RESUME = {"seed": "the data order and the random streams continue from the checkpoint's, so a new seed "
                           "would not take effect"}
LAYOUT_OPTIONS = ("G_data", "G_inter", "G_intra_r", "G_intra_c", "G_intra_d", "context_parallel", "cp_algo", "tp_style",
                  "sequence_parallel", "schedule", "virtual_stages", "microbatches", "fsdp", "expert_parallel")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=["gpt", "llama"], default="gpt",
                   help="gpt: GPT-2's shape (learned positions, LayerNorm, GELU); llama: RMSNorm, rotary positions, "
                        "grouped-query attention, SwiGLU (docs/llama.md)")
    g.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    g.add_argument("--n-head", type=int, default=4, help="attention heads")
    g.add_argument("--n-embd", type=int, default=128, help="width; must divide by --n-head")
    g.add_argument("--block-size", type=int, default=64, help="context length in characters")
    g.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=None, metavar="N",
                   help="Megatron's vocabulary padding (GPT and Llama): the embedding and lm_head get the "
                        "vocabulary rounded up to a multiple of N x the Megatron tensor size (Megatron's default N "
                        "is 128); the padding rows are masked out of the loss and the sampler, and exports write "
                        "the real vocabulary (default: "
                        "padded only when the tensor size does not divide it, to its next multiple)")
    g.add_argument("--init-from", default=None, metavar="hf:DIR",
                   help="fine-tune: start from a Hugging Face GPT-2 or Llama directory (config.json + safetensors, "
                        "what save_pretrained writes; read locally, nothing is downloaded). The model's shape "
                        "(--model, layers, heads, width, vocabulary, tie) is the directory's; --block-size must not "
                        "exceed its positions. Used on a fresh start only: a resume reads its checkpoint")
    g.add_argument("--tie-word-embeddings", action="store_true",
                   help="GPT-2's tied head: lm_head.weight is wte.weight (with a pipeline: a copy on the first and "
                        "last stage, their gradients summed; with --sequence-parallel: split over the vocabulary: "
                        "docs/hybrid.md)")
    g.add_argument("--moe-experts", type=int, default=0,
                   help="mixture of experts: E expert MLPs replace the MLP of every (--moe-every 2: every other) "
                        "block; 0: dense (docs/moe.md)")
    g.add_argument("--moe-top-k", type=int, default=1, choices=[1, 2], help="experts per token")
    g.add_argument("--moe-every", type=int, default=1, choices=[1, 2], help="MoE in every block (1) or every other (2)")
    g.add_argument("--moe-capacity-factor", type=float, default=None,
                   help="drop tokens past capacity_factor * tokens * k / E per expert (Switch); default: dropless")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=1e-2, help="weight of the load-balancing loss")
    g.add_argument("--moe-z-loss-coeff", type=float, default=1e-3, help="weight of the router z-loss")
    g.add_argument("--n-kv-head", type=int, default=None,
                   help="--model llama: key/value heads, dividing --n-head (default: --n-head); fewer than "
                        "--G-intra-c: each replicated over the tensor ranks that share it (Megatron's rule)")
    g.add_argument("--ffn-hidden", type=int, default=None,
                   help="--model llama: the SwiGLU width (default: Meta's rule, 2/3 of 4 x --n-embd rounded up to 256)")
    g.add_argument("--rope-theta", type=float, default=None, help="--model llama: the rotary base (default 10000)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=300,
                   help="optimizer steps in total; on --resume a larger value extends the LR schedule")
    g.add_argument("--global-batch", type=int, default=32,
                   help="sequences per step over all ranks; must divide by the number of ranks")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm; 0 disables")
    g.add_argument("--seed", type=int, default=0, help="seed of init, data order and sampling")
    g.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="parameter dtype")
    g = p.add_argument_group(
        "layout (AxoNN's five sizes; their product is the number of ranks). `tp` always means Megatron tensor "
        "parallelism, here, in --layout and in `axonmpi plan`: --tp N is --G-intra-c N --tp-style megatron; "
        "AxoNN's 3-D split is --G-intra-r/c/d with --tp-style axonn (the planner's row/col/depth)")
    g.add_argument("--layout", default=None, metavar="SPEC",
                   help="the layout as `axonmpi plan` prints it, pasted: \"tp=2,pp=2,dp=2,sp=1,zero=1,schedule=zbv\" "
                        "(keys tp pp dp vp cp ep sp zero shard row col depth schedule cp_kind; tp: Megatron; "
                        "row/col/depth: AxoNN; vp=V is --schedule interleaved --virtual-stages V; zero=1: --zero 1, "
                        "zero=2/3: --fsdp shard_grad_op/full_shard, shard=N: hybrid_shard). Replaces the size flags below, which "
                        "may not be given with it")
    g.add_argument("--tp", type=int, default=None, metavar="N",
                   help="Megatron tensor parallelism over N ranks (the planner's tp): --G-intra-c N --tp-style megatron")
    g.add_argument("--zero", type=int, choices=[0, 1], default=0,
                   help="1: ZeRO-1 (the planner's zero=1): AdamW's moments split over the data ranks "
                        "(ZeroRedundancyOptimizer), gradients all-reduced as DDP; needs more than one data rank "
                        "and no --fsdp (zero=2/3 are --fsdp shard_grad_op/full_shard)")
    g.add_argument("--G-data", type=int, default=None, help="data-parallel replicas (default: what the others leave)")
    g.add_argument("--G-inter", type=int, default=1, help="pipeline stages")
    g.add_argument("--G-intra-r", type=int, default=1, help="tensor parallel: rows of each weight (AxoNN)")
    g.add_argument("--G-intra-c", type=int, default=1, help="tensor parallel: columns of each weight")
    g.add_argument("--G-intra-d", type=int, default=1, help="tensor parallel: depth (AxoNN's weight sharding)")
    g.add_argument("--context-parallel", type=int, default=1, metavar="N",
                   help="context parallelism: N ranks (G_context) hold different chunks of the same sequences "
                        "(docs/context_parallel.md); with data, tensor, sequence parallel, FSDP, MoE and pipelines (the "
                        "embedding stage numbers each rank's tokens at their positions)")
    g.add_argument("--cp-algo", choices=["ring", "ulysses"], default="ring",
                   help="with --context-parallel: ring attention (K/V passed around, causal load balancing) or "
                        "DeepSpeed-Ulysses all-to-all (--n-head must divide by N)")
    g.add_argument("--expert-parallel", type=int, default=1,
                   help="with --moe-experts: split the experts over N ranks of the data dimension (N divides "
                        "--G-data and --moe-experts; tokens move by all-to-all)")
    g.add_argument("--tp-style", choices=["megatron", "axonn"], default="axonn",
                   help="megatron: heads/MLP/vocabulary over G-intra-c; axonn: every Linear over r x c x d")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp-style megatron: Megatron's sequence parallelism (LayerNorm, dropout and residuals on "
                        "sequence shards over G-intra-c; --block-size must divide by it); with pipelines, context "
                        "parallel, MoE (router losses over the global tokens), FSDP and --tie-word-embeddings")
    g.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"], default="1f1b",
                   help="pipeline schedule (interleaved: 2 virtual stages per rank; zb-h1, zbv: zero bubble, "
                        "ZBV with 2 chunks per rank in a V); another than 1f1b without a pipeline is refused")
    g.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="with --schedule interleaved: model chunks per pipeline rank (the planner's vp; default 2)")
    g.add_argument("--microbatches", type=int, default=None,
                   help="pipeline micro-batches per step (default 1; with --layout and a pipeline: one sequence "
                        "per micro-batch, the planner's micro-batch 1); more than 1 without a pipeline is refused")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each pipeline chunk's (without a pipeline: each top-level layer's) activations "
                        "in backward")
    g.add_argument("--fsdp", choices=["none", "shard_grad_op", "full_shard", "hybrid_shard"], default="none",
                   help="shard parameters, gradients and optimizer state over the data ranks "
                        "(FullyShardedDataParallel; with tensor parallel, a pipeline (each stage's flat shard), context and "
                        "activation checkpointing)")
    g.add_argument("--hybrid-shard-size", type=int, default=None,
                   help="with --fsdp hybrid_shard: data ranks per shard group (default: the ranks of one node)")
    g.add_argument("--cpu-offload", action="store_true",
                   help="with --fsdp: keep the parameter shards, gradients and optimizer state on the host")
    g.add_argument("--mixed-precision", choices=["none", "fp16", "bf16"], default="none",
                   help="fp16 (with --fsdp): compute in float16, reduce gradients in float32, dynamic loss "
                        "scaling; bf16: compute in bfloat16 (ml_dtypes), reduce gradients in float32, no "
                        "scaling, float32 master weights; with --fsdp none it runs data parallel as FSDP "
                        "no_shard (every rank holds every parameter, gradients all-reduced: DDP)")
    g.add_argument("--init-loss-scale", type=float, default=2.0 ** 16,
                   help="with --mixed-precision fp16: the loss scaler's first scale")
    g.add_argument("--loss-scale-growth-interval", type=int, default=2000,
                   help="with --mixed-precision fp16: clean steps before the loss scale doubles")
    g.add_argument("--dump-params", default=None, metavar="PATH",
                   help="rank 0 writes the final full (serial-named) parameters to PATH (.npz)")
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="token files: a folder of train.bin / val.bin / meta.json (examples/prepare_data.py), or one "
                        ".bin file (its last 10%% held out); nanoGPT's header-free uint16/uint32 ids, memory-mapped, "
                        "windows of --block-size + 1 tokens every --block-size tokens (default: the standard "
                        "library's source, characters)")
    g.add_argument("--data-dtype", choices=["uint16", "uint32"], default=None,
                   help="with --data: the token width (default: meta.json's, else uint16 as nanoGPT)")
    g.add_argument("--corpus-bytes", type=int, default=1 << 20, help="bytes of standard-library source to train on")
    g.add_argument("--eval-batches", type=int, default=8,
                   help="held-out batches for the final evaluation (0: none, no held-out loss in the summary)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", default="checkpoints/gpt", help="where checkpoints go")
    g.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    g.add_argument("--keep-last", type=int, default=2, help="checkpoints kept")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    g.add_argument("--auto-resume", action="store_true",
                   help="continue from the latest checkpoint if there is one, else start fresh (re-submitted jobs)")
    g.add_argument("--overwrite", action="store_true",
                   help="start fresh even though --checkpoint-dir holds checkpoints (deletes them)")
    g.add_argument("--no-save", action="store_true", help="write no checkpoint (--resume still reads one)")
    g.add_argument("--async-save", action="store_true",
                   help="--save-every checkpoints are written in a background thread while training goes on "
                        "(a copy of the state in host memory; the next save or the end waits for it)")
    g.add_argument("--memory-checkpoint-every", type=int, metavar="N",
                   default=int(os.environ.get("AXONMPI_MEMORY_CHECKPOINT_EVERY") or 0),
                   help="every N steps a copy of the state in node memory (AXONMPI_MEMORY_DIR, /dev/shm), sent to a "
                        "buddy rank on another node; --auto-resume takes the newest step complete in memory when it is "
                        "at least as new as the newest checkpoint (a lost node costs one step); removed at a clean end. "
                        "0: off (default; AXONMPI_MEMORY_CHECKPOINT_EVERY sets it, the jobs/ templates to 1). "
                        "docs/checkpoints.md")
    g.add_argument("--no-preemption-save", action="store_true",
                   help="do not catch SIGTERM/SIGUSR1 (by default they make every rank save at the next step "
                        "and exit with code 75, which the job templates requeue)")
    g = p.add_argument_group("output")
    g.add_argument("--sample-chars", type=int, default=200, help="characters to generate at the end (0: none)")
    bars = g.add_mutually_exclusive_group()
    bars.add_argument("--no-progress", action="store_true",
                      help="log lines instead of a progress bar (automatic when rank 0's stderr, or the launcher's "
                           "under mpiexec, is not a terminal)")
    bars.add_argument("--progress", action="store_true",
                      help="force rank 0's progress bar, on stderr, even when it is a pipe (under mpiexec "
                           "it shows on the launcher's stderr)")
    g.add_argument("--log-every", type=int, default=25, help="a log line every N steps without a progress bar")
    g.add_argument("--peak-tflops", type=float, default=None, metavar="TF",
                   help="peak TFLOP/s of one rank's device, for the MFU in log lines, the bar and --metrics-json "
                        "(default: the detected GPU's dense peak for the dtype; none on CPU: MFU not shown)")
    g.add_argument("--metrics-json", default=None, metavar="PATH",
                   help="one JSON line per step (step, loss, grad_norm, lr, step_s, tokens_per_s (this step's), "
                        "tokens_per_s_avg (a moving average, the first step left out), mfu (with a peak), "
                        "host_peak_rss_gib, device_gib (on a GPU), epoch, sample (global samples read this epoch), tokens (seen "
                        "in all), time (UTC), and loss_scale with --mixed-precision fp16; with --moe-experts also "
                        "aux_loss, z_loss, tokens_per_expert_min/mean/max and dropped_tokens); rank 0 writes. A "
                        "fresh run starts the file anew; a resumed one keeps the rows up to the resumed step and "
                        "appends. Default: metrics.jsonl in the --checkpoint-dir (the run folder) when saving")
    g.add_argument("--trace", default=None, metavar="DIR",
                   help="write a Chrome/Perfetto timeline per rank to DIR/trace_rank<r>.json (collectives, forward, "
                        "backward, FSDP, pipeline, checkpoints); merge with `axonmpi trace merge DIR`")
    args = axonmpi.log.rank0_parser(p).parse_args(argv)
    bad = count_problem(args)
    if bad:
        p.exit(2, f"{p.prog}: error: {bad}\n")   # one line naming the flag (rank 0 prints it)
    if args.hybrid_shard_size is not None and args.fsdp != "hybrid_shard":
        p.error(f"--hybrid-shard-size {args.hybrid_shard_size} needs --fsdp hybrid_shard, got --fsdp {args.fsdp}")
    if args.fsdp == "none" and (args.cpu_offload or args.mixed_precision == "fp16"):
        p.error("--cpu-offload and --mixed-precision fp16 need --fsdp shard_grad_op|full_shard|hybrid_shard")
    if args.overwrite and (args.resume or args.auto_resume):
        p.error("--overwrite starts fresh; it cannot be combined with --resume/--auto-resume")
    other = model_problem(args) or apply_layout(args) or layout_problem(args)
    if other:
        p.error(other)
    if args.microbatches is None:
        args.microbatches = 1
    if args.init_from is not None and not args.init_from.startswith("hf:"):
        p.error(f"--init-from {args.init_from}: expected hf:DIR (a Hugging Face GPT-2 or Llama directory)")
    return args


# the flags --layout replaces, with their defaults (one given beside --layout is refused, naming it)
LAYOUT_DEFAULTS = {"G_data": None, "G_inter": 1, "G_intra_r": 1, "G_intra_c": 1, "G_intra_d": 1, "context_parallel": 1,
                   "expert_parallel": 1, "tp": None, "tp_style": "axonn", "sequence_parallel": False,
                   "schedule": "1f1b", "virtual_stages": None, "fsdp": "none", "zero": 0, "hybrid_shard_size": None, "cp_algo": "ring"}


def apply_layout(args) -> "str | None":
    """Write ``--tp`` and ``--layout`` (the planner's string) into the five sizes and their options; a problem as
    one line (else None).  ``tp`` is Megatron's everywhere: ``--G-intra-c tp --tp-style megatron``."""
    if args.layout is None:
        if args.tp is not None:
            if (args.G_intra_r, args.G_intra_c, args.G_intra_d) != (1, 1, 1):
                return (f"--tp {args.tp} is --G-intra-c {args.tp} --tp-style megatron; it cannot be combined with "
                        "--G-intra-r/--G-intra-c/--G-intra-d (AxoNN's split): give one of them")
            args.G_intra_c, args.tp_style = args.tp, "megatron"
        return None
    given = [f"--{k.replace('_', '-')}" for k, d in LAYOUT_DEFAULTS.items() if getattr(args, k) != d]
    if given:
        return f"--layout {args.layout!r} gives the whole layout: leave out {' '.join(given)}"
    from axonmpi.planner import ParallelLayout
    try:
        lay = ParallelLayout.parse(args.layout)
    except (ValueError, TypeError) as e:
        return str(e)
    said = f"--layout {args.layout!r}"
    if lay.tp_overlap or not lay.overlap or not lay.reduce_overlap:
        return (f"{said}: overlap={lay.overlap}, reduce_overlap={lay.reduce_overlap}, tp_overlap={lay.tp_overlap} "
                "are the planner's models of other runtimes; axonmpi always overlaps its gradient reductions "
                "(overlap=1, reduce_overlap=1) and not its tensor-parallel all-reduces (tp_overlap=0): drop them")
    if lay.zero == 2 and lay.shard and lay.shard != lay.dp:
        return (f"{said}: zero=2 with shard={lay.shard}: FSDP's hybrid shard is ZeRO-3 inside each shard group; use "
                "zero=3,shard=N")
    args.G_data, args.G_inter, args.context_parallel, args.expert_parallel = lay.dp, lay.pp, lay.cp, lay.ep
    args.cp_algo, args.sequence_parallel = lay.cp_kind, bool(lay.sp)
    if lay.axonn > 1:
        args.G_intra_r, args.G_intra_c, args.G_intra_d, args.tp_style = lay.row, lay.col, lay.depth, "axonn"
    elif lay.tp > 1:
        args.G_intra_c, args.tp_style = lay.tp, "megatron"
    if lay.pp > 1:
        args.schedule = lay.pipeline_schedule
        if args.schedule == "interleaved":
            args.virtual_stages = lay.vp
        if args.microbatches is None:        # the planner's micro-batch of 1 sequence
            args.microbatches = max(1, args.global_batch // (lay.dp * lay.axonn))
    if lay.zero == 1:
        args.zero = 1
    elif lay.zero >= 2:
        hybrid = bool(lay.shard) and lay.shard != lay.dp
        args.fsdp = "hybrid_shard" if hybrid else ("shard_grad_op" if lay.zero == 2 else "full_shard")
        args.hybrid_shard_size = lay.shard if hybrid else None
    return None


def layout_problem(args) -> "str | None":
    """A flag that does nothing in the chosen layout (one line naming it and why), else None."""
    if args.schedule != "1f1b" and args.G_inter == 1:
        return (f"--schedule {args.schedule} does nothing without a pipeline: add --G-inter N (pp=N in --layout) "
                "or leave --schedule out")
    if args.virtual_stages is not None and args.schedule != "interleaved":
        return (f"--virtual-stages {args.virtual_stages} does nothing with --schedule {args.schedule}: it is the "
                "interleaved schedule's chunks per rank (ZBV runs 2)")
    if args.microbatches is not None and args.microbatches > 1 and args.G_inter == 1:
        return (f"--microbatches {args.microbatches} does nothing without a pipeline (the whole batch is one "
                "forward and backward): add --G-inter N or leave it out")
    if args.cp_algo != "ring" and args.context_parallel == 1:
        return f"--cp-algo {args.cp_algo} does nothing without --context-parallel N (N > 1)"
    if args.zero and args.fsdp != "none":
        return (f"--zero 1 with --fsdp {args.fsdp}: FSDP already shards the optimizer state (zero=2/3 are "
                "--fsdp shard_grad_op/full_shard); give one")
    return None


def model_problem(args) -> "str | None":
    """A flag the chosen --model does not read (one line naming it and the fix), else None."""
    if args.model == "gpt":
        given = [n for n in LLAMA_ONLY if getattr(args, n) is not None]
        return (f"--{given[0].replace('_', '-')} is a Llama option: add --model llama" if given else None)
    for name, off, why in (("moe_experts", 0, "the Llama recipe has no MoE variant yet (docs/llama.md)"),
                           ("dropout", 0.0, "the Llama has no dropout")):
        if getattr(args, name) != off:
            return f"--{name.replace('_', '-')} {getattr(args, name)} with --model llama: {why}"
    return None


# counts and amounts that make no sense at zero or below (None: the option was left out)
AT_LEAST_1 = ("n_layer", "n_head", "n_embd", "block_size", "steps", "global_batch", "log_every", "keep_last", "tp",
              "n_kv_head", "ffn_hidden",
              "microbatches", "virtual_stages", "G_data", "G_inter", "G_intra_r", "G_intra_c", "G_intra_d", "context_parallel",
              "expert_parallel", "hybrid_shard_size", "corpus_bytes", "loss_scale_growth_interval",
              "make_vocab_size_divisible_by")
AT_LEAST_0 = {"save_every": "0: only at the end", "warmup": "0: none", "sample_chars": "0: none",
              "moe_experts": "0: dense", "seed": None, "grad_clip": "0: no clipping", "weight_decay": None,
              "moe_aux_loss_coeff": None, "moe_z_loss_coeff": None, "memory_checkpoint_every": "0: off",
              "eval_batches": "0: no final evaluation"}
ABOVE_0 = ("lr", "init_loss_scale", "moe_capacity_factor", "rope_theta", "peak_tflops")


def count_problem(args) -> "str | None":
    """The first option whose value makes no sense (a count below 1, a negative amount), as one line; else None."""
    def flag(name):
        return "--" + name.replace("_", "-")
    for name in AT_LEAST_1:
        v = getattr(args, name, None)
        if v is not None and v < 1:
            return f"{flag(name)} must be a whole number >= 1, got {v}"
    for name, zero in AT_LEAST_0.items():
        v = getattr(args, name, None)
        if v is not None and not v >= 0:     # nan too
            return f"{flag(name)} must be >= 0{f' ({zero})' if zero else ''}, got {v}"
    for name in ABOVE_0:
        v = getattr(args, name, None)
        if v is not None and not v > 0:
            return f"{flag(name)} must be > 0, got {v}"
    if not 0 <= args.dropout < 1:           # nan too
        return f"--dropout must be a probability in [0, 1), got {args.dropout}"
    return None


def _mixed_precision(mode: str):
    """FSDP's MixedPrecision for --mixed-precision: compute in 16 bits, reduce gradients in float32."""
    if mode == "none":
        return None
    return MixedPrecision(param_dtype=np.float16 if mode == "fp16" else "bfloat16", reduce_dtype=np.float32)


def config_mismatch(saved: dict, args) -> list:
    """``["--n-embd 64 vs saved 128", ...]`` for every shape-defining option that differs from the checkpoint."""
    out = []
    for name in ARCH_OPTIONS:
        if name in saved and saved[name] != getattr(args, name, None):
            if name == "vocab_rows":     # padded for another tensor size
                out.append(f"the vocabulary padded to {args.vocab_rows} rows for this layout vs {saved[name]} saved "
                           "(pass --make-vocab-size-divisible-by N so that both tensor sizes pad alike)")
            else:
                out.append(f"--{name.replace('_', '-')} {getattr(args, name)} vs saved {saved[name]}")
    return out


def fixed_option_changes(saved: dict, args) -> list:
    """``["--seed 5 vs saved 0 (why)", ...]`` for every option a resume cannot change."""
    return [f"--{name.replace('_', '-')} {getattr(args, name)} vs saved {saved[name]} ({why})"
            for name, why in FIXED_ON_RESUME.items() if name in saved and saved[name] != getattr(args, name)]


def apply_changed_options(saved: dict, args, sched, log) -> None:
    """Apply the training options changed since the checkpoint (lr, warmup, weight decay, ...), one log line each.

    The optimizer's and the schedule's restored state carry the saved values; this writes the new ones
    into them, so what the next checkpoint records (``vars(args)``) is what is in effect.
    """
    changed = [n for n in APPLIED_ON_RESUME if n in saved and saved[n] != getattr(args, n)]
    for name in changed:
        log.info("--resume: --%s %s -> %s (changed since the checkpoint; applied from this step on)",
                 name.replace("_", "-"), saved[name], getattr(args, name))
    groups = sched.optimizer.param_groups
    if "lr" in changed:
        sched.base_lrs = [float(args.lr)] * len(groups)
        sched.min_lr = args.lr * 0.1
        for pg in groups:
            pg["initial_lr"] = float(args.lr)
    if "warmup" in changed:
        sched.warmup_steps = min(args.warmup, args.steps // 2)
    if "weight_decay" in changed:
        for pg in groups:
            pg["weight_decay"] = args.weight_decay
    if "lr" in changed or "warmup" in changed:
        sched.last_epoch -= 1
        sched.step()   # this step's lr on the new values, written into the optimizer


def open_metrics(path, step, resumed, log):
    """Rank 0's ``--metrics-json`` file: started anew on a fresh run; on a resume at ``step``, rows after it
    (steps trained after the checkpoint and lost with the job) are dropped before appending."""
    if not resumed or not os.path.exists(path):
        return open(path, "w", encoding="utf-8")
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                keep = int(json.loads(line)["step"]) <= step
            except (ValueError, KeyError, TypeError):
                keep = False   # a line cut short by a killed job
            kept.append(line) if keep else None
            dropped += not keep
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    if dropped:
        log.info("--metrics-json %s: dropped %d row(s) after the resumed step %d", path, dropped, step)
    return open(path, "a", encoding="utf-8")


def evaluate(hyb, tokens, block, batches, batch, seed):
    """Mean loss on ``batches`` random global batches of windows of the held-out tokens."""
    rng = np.random.default_rng((seed, 99))
    ds = TokenFileDataset(tokens, block, stride=1)      # every offset, read from the array or memory map
    hyb.model.eval()
    losses = []
    for _ in range(batches):
        idx = rng.integers(0, len(ds), batch)
        x, y = ds.get_batch(idx)
        losses.append(hyb.eval_loss(hyb.local_batch(x), hyb.local_batch(y)))
    hyb.model.train()
    return float(np.mean(losses))


def open_checkpoints(args, world, log):
    """The CheckpointManager (None with --no-save and no resume) and the checkpoint to resume from (or None).

    A fresh run into a folder that already holds checkpoints stops with the choices
    (--resume, --overwrite, another --checkpoint-dir) instead of mixing two runs in one folder.
    """
    resuming = args.resume or args.auto_resume
    if args.no_save and not resuming:
        return None, None
    mgr = ckpt.CheckpointManager(args.checkpoint_dir, keep_last=args.keep_last)
    if not args.no_save:
        try:
            mgr.acquire()   # a second job on the same folder stops here, before it deletes or writes anything
        except ckpt.FolderInUseError as e:   # raised by rank 0, the same error type on the others
            axonmpi.log.exit0(str(e))
    steps, damaged = axonmpi.broadcast_object((mgr.steps(), mgr.damaged()) if world.rank == 0 else None)
    if resuming and not steps and damaged:   # a folder of damaged checkpoints is not a fresh run
        axonmpi.log.exit0(
            f"{'--resume' if args.resume else '--auto-resume'}: {args.checkpoint_dir!r} holds no intact checkpoint, only "
            f"ones set aside as damaged: {damaged} (`axonmpi ckpt verify {args.checkpoint_dir}` lists their problems). "
            "Nothing was loaded; move them out of the folder to start fresh", code=1)
    if args.resume and not steps:
        axonmpi.log.exit0(f"--resume: no checkpoint found in {args.checkpoint_dir!r}; run without --resume first")
    if not resuming and steps:
        if not args.overwrite:
            axonmpi.log.exit0(
                f"--checkpoint-dir {args.checkpoint_dir!r} already holds checkpoints of steps {steps}; pass "
                "--resume to continue that run, --overwrite to delete them and start fresh, or choose another "
                "--checkpoint-dir")
        mgr.clear()
        log.info("--overwrite: removed the checkpoints of steps %s from %s", steps, args.checkpoint_dir)
    if args.auto_resume and not steps:
        log.info("--auto-resume: no checkpoint in %s: starting fresh", args.checkpoint_dir)
    return mgr, (mgr.path_for(steps[-1]) if resuming and steps else None)


def open_memory_checkpoints(args, mgr, log):
    """[memory checkpoints] (issue 53) The MemoryCheckpointer of --memory-checkpoint-every N (None: off), and the
    copy in node memory to resume from (None: the HDF5 checkpoint, or a fresh start), saying which."""
    from axonmpi.checkpoint import memory
    if not args.memory_checkpoint_every or mgr is None or args.no_save:
        return None, None
    resuming = args.resume or args.auto_resume
    mem = memory.MemoryCheckpointer(memory.run_key(args.checkpoint_dir, new=not resuming),
                                    every=args.memory_checkpoint_every, fresh=not resuming)
    if resuming:
        memory.log_restart_time(log)
    return mem, (memory.pick_source(mgr, mem, log) if resuming else None)


def checkpoint_extra(args, cfg, hyb, scaler) -> dict:
    """What a checkpoint keeps beside the state: the options, the layout, the loss scaler's state."""
    config = dict(vars(args))
    if args.model == "llama":     # the Llama's own fields too: ckpt export --format hf-llama reads them
        config["llama"] = cfg.to_dict()
    extra = {"config": config, "layout": hyb.layout_record()}
    if scaler is not None:
        extra["scaler"] = scaler.state_dict()       # the loss scale and growth count continue on --resume
    return extra


def resume(path, args, world, log, model, opt, sched, sampler, scaler=None):
    """Restore the run saved at ``path`` (and the loss scaler's state with --mixed-precision fp16); check its
    config first; extend the LR schedule to ``--steps``."""
    load = path.load if hasattr(path, "load") else functools.partial(ckpt.load, path)   # a path or a memory copy
    extra = load({"extra": {}}, strict=False).get("extra") or {}
    saved = extra.get("config") or {}
    diff = config_mismatch(saved, args)
    if diff:
        axonmpi.log.exit0(f"{path} was saved with another model: {'; '.join(diff)}. Pass the saved values "
                          "to resume, or start a new run in another --checkpoint-dir")
    fixed = fixed_option_changes(saved, args)
    if fixed:
        axonmpi.log.exit0(f"{path}: a resume cannot change {'; '.join(fixed)}. Pass the saved values to resume, "
                          "or start a new run in another --checkpoint-dir")
    loaded = load(model.sharded_state().checkpoint_template(path))   # each rank reads only its blocks
    meta = ckpt.restore_training_state(loaded, model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    step = int(meta["step"])
    log.info("resumed at step %d; the logged moving average starts again from this run's first step", step)
    apply_changed_options(saved, args, sched, log)
    if scaler is not None:
        if extra.get("scaler"):
            scaler.load_state_dict(extra["scaler"])
            log.info("loss scale %g (growth tracker %d) restored", scaler.get_scale(),
                     scaler.state_dict()["_growth_tracker"])
        else:
            log.warning("%s holds no loss-scaler state (saved without --mixed-precision fp16): starting from "
                        "scale %g", path, scaler.get_scale())
    saved_ranks = int(meta.get("world_size", world.world_size))
    layout = {k: saved[k] for k in LAYOUT_OPTIONS if k in saved}
    if layout.get("G_data", 0) is None:   # "whatever is left" when saved: show the size it was
        rest = 1
        for k in ("G_inter", "G_intra_r", "G_intra_c", "G_intra_d", "context_parallel"):
            rest *= int(layout.get(k) or 1)
        layout["G_data"] = saved_ranks // rest
    log.info("%sresumed from %s at step %d (saved on %d ranks%s)", "--auto-resume: " if args.auto_resume else "",
             path, step, saved_ranks,
             ", layout " + " ".join(f"{k}={v}" for k, v in layout.items()) if layout else "")
    if saved_ranks != world.world_size:
        # a continuation of the random streams is impossible on another rank count: derive one
        # independent stream per rank from the seed and the step, the same way on every rank
        axonmpi.manual_seed(int(args.seed) * 1000 + model.batch_shards[1] + 7919 * step)   # hyb.dropout_seed
        log.warning("saved on %d ranks, resumed on %d: dropout/sampling streams re-seeded per rank "
                    "(deterministic, not a continuation)", saved_ranks, world.world_size)
    if args.steps != sched.total_steps and args.steps > step:
        old = sched.total_steps
        sched.total_steps = max(args.steps, sched.warmup_steps + 1)
        sched.last_epoch -= 1
        sched.step()  # recompute this step's lr on the new horizon and write it into the optimizer
        log.info("LR schedule %s from %d to %d steps (lr now %.2e)", "extended" if args.steps > old else "shortened",
                 old, sched.total_steps, sched.get_last_lr()[0])
    if step >= args.steps:
        log.info("nothing to do: checkpoint step %d >= --steps %d; raise --steps to train longer", step, args.steps)
    return step


class Data(NamedTuple):
    """What the trainer reads: the training windows, the held-out tokens, how to show tokens as text."""
    train: Any                     # a Dataset of (x, y) windows
    val: Any                       # held-out token ids (an array or a memory map)
    vocab_size: int
    h_unigram: float               # entropy of the token frequencies: the loss of a context-free model
    decode: Callable[[Any], str]
    prompt: np.ndarray             # the generated sample's first tokens
    unit: str                      # "chars" / "tokens"
    describe: str


def load_data(args) -> Data:
    """``--data`` token files (memory-mapped; nanoGPT's layout) or, by default, the standard library's source as
    characters (download-free)."""
    if args.data is None:
        text = load_stdlib_corpus(max_bytes=args.corpus_bytes)
        tok = CharTokenizer(text)
        ids = tok.encode(text)
        split = int(0.9 * len(ids))
        train, val = ids[:split], ids[split:]
        return Data(CharDataset(train, args.block_size), val, tok.vocab_size, unigram_entropy(train), tok.decode,
                    tok.encode("def "), "chars", f"{len(train)} train chars")
    try:
        train_path, val_path = token_files(args.data)
        meta = read_token_meta(args.data)
        tokens = open_tokens(train_path, args.data_dtype)
        if val_path is not None:
            val = open_tokens(val_path, args.data_dtype)
        else:                       # one file: its last 10% held out, as the character corpus
            split = int(0.9 * len(tokens))
            tokens, val = tokens[:split], tokens[split:]
        train = TokenFileDataset(tokens, args.block_size)
        if len(val) <= args.block_size:
            raise ValueError(f"--data {args.data}: {len(val)} held-out tokens cannot make one window of "
                             f"--block-size {args.block_size} + 1")
    except (OSError, ValueError) as e:
        axonmpi.log.exit0(f"--data: {e}")
    vocab = meta.get("vocab_size") or 1 + max(train.max_token(), int(np.max(val)))
    head = np.asarray(tokens[:1 << 22])        # the unigram baseline from the first 4M tokens
    return Data(train, val, int(vocab), unigram_entropy(head), _decoder(args.data, meta),
                np.asarray(val[:4], dtype=np.int64), "tokens",
                f"{len(tokens):,} train tokens ({tokens.dtype.name}, {meta.get('tokenizer', 'no meta.json')}) "
                f"in {len(train):,} windows")


def _decoder(path: str, meta: dict) -> Callable[[Any], str]:
    """Token ids -> text with the tokenizer prepare_data.py recorded (bytes, or its copy of a HF tokenizer)."""
    def ids_of(a):
        return [int(i) for i in np.asarray(a.get() if hasattr(a, "get") else a).reshape(-1)]
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    saved = meta.get("tokenizer_path")
    try:
        if meta.get("tokenizer") == "bytes":
            return lambda a: bytes(min(i, 255) for i in ids_of(a)).decode("utf-8", errors="replace")
        if meta.get("tokenizer") == "tokenizer.json" and saved:
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(os.path.join(folder, saved))
            return lambda a: tok.decode(ids_of(a))
        if meta.get("tokenizer") == "transformers" and saved:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(os.path.join(folder, saved), local_files_only=True)
            return lambda a: tok.decode(ids_of(a))
    except (ImportError, OSError, ValueError):
        pass
    return lambda a: " ".join(map(str, ids_of(a)))       # no tokenizer to read: the ids


class HFSource(NamedTuple):
    kind: str                      # "gpt2" / "llama"
    config: Any                    # GPTConfig keyword arguments (gpt2) or a LlamaConfig
    state_dict: dict               # the serial model's names


def read_init_from(args) -> HFSource:
    """``--init-from hf:DIR``: the directory's config and weights (under our serial names); the model flags are
    set to the directory's shape (logged), so checkpoints record what was trained."""
    from axonmpi.models import GPT, Llama
    from axonmpi.models.hf_files import CONFIG_FILE
    d = args.init_from[3:]
    path = os.path.join(d, CONFIG_FILE)
    try:
        with open(path) as f:
            kind = json.load(f).get("model_type")
        if kind == "gpt2":
            from axonmpi.models import hf_gpt2
            _, kw = hf_gpt2.read_directory(d)
            model = GPT.from_hf(d, dtype=np.float64)
            args.model, args.n_layer, args.n_head, args.n_embd = "gpt", kw["n_layer"], kw["n_head"], kw["n_embd"]
            args.tie_word_embeddings = kw["tie_word_embeddings"]
            config = dict(kw)
        elif kind == "llama":
            model = Llama.from_hf(d, dtype=np.float64)
            config = model.config
            args.model, args.n_layer, args.n_head, args.n_embd = "llama", config.n_layer, config.n_head, config.n_embd
            args.n_kv_head, args.ffn_hidden, args.rope_theta = config.n_kv_head, config.intermediate_size, \
                config.rope_theta
            args.tie_word_embeddings = config.tie_word_embeddings
        else:
            raise ValueError(f"{path} has model_type={kind!r}; --init-from reads gpt2 and llama")
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        axonmpi.log.exit0(f"--init-from {args.init_from}: {e}")
    if kind == "llama" and (args.dropout or args.moe_experts):
        axonmpi.log.exit0(f"--init-from {args.init_from}: a Llama has no dropout and no MoE variant")
    if args.moe_experts:
        axonmpi.log.exit0(f"--init-from {args.init_from}: GPT-2 is dense; leave --moe-experts out")
    return HFSource(kind, config, model.state_dict())


def model_config(args, grid, data_vocab: int, hf: Optional[HFSource]):
    """The GPTConfig / LlamaConfig: the flags' shape, or ``--init-from``'s; the vocabulary padded for the
    Megatron tensor size (``--make-vocab-size-divisible-by``, else only as far as the tensor size needs)."""
    vocab = data_vocab if hf is None else (hf.config["vocab_size"] if hf.kind == "gpt2" else hf.config.vocab_size)
    if vocab < data_vocab:
        raise ValueError(f"--init-from {args.init_from}: the model's vocabulary of {vocab} is smaller than the data's "
                         f"{data_vocab}: tokenize with the model's tokenizer (examples/prepare_data.py --tokenizer)")
    args.vocab_size = vocab          # saved with the config: exports write these rows only
    tp = grid.G_intra_c if args.tp_style == "megatron" else 1
    pad = padded_vocab_size(vocab, args.make_vocab_size_divisible_by or 1, tp)
    pad = None if pad == vocab else pad
    args.vocab_rows = vocab if pad is None else pad
    if hf is not None and hf.kind == "llama":
        if args.block_size > hf.config.block_size:
            raise ValueError(f"--block-size {args.block_size} exceeds {args.init_from}'s max_position_embeddings "
                             f"{hf.config.block_size}")
        return dataclasses.replace(hf.config, padded_vocab_size=pad)
    if hf is not None:
        if args.block_size > hf.config["block_size"]:
            raise ValueError(f"--block-size {args.block_size} exceeds {args.init_from}'s n_positions "
                             f"{hf.config['block_size']}")
        return GPTConfig(**{**hf.config, "padded_vocab_size": pad, "dropout": args.dropout})
    if args.model == "llama":
        return LlamaConfig(vocab_size=vocab, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
                           n_kv_head=args.n_kv_head, intermediate_size=args.ffn_hidden, block_size=args.block_size,
                           rope_theta=10000.0 if args.rope_theta is None else args.rope_theta,
                           tie_word_embeddings=args.tie_word_embeddings, padded_vocab_size=pad)
    cfg = GPTConfig(vocab_size=vocab, padded_vocab_size=pad, block_size=args.block_size,
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout,
                    moe_experts=args.moe_experts, moe_top_k=args.moe_top_k, moe_every=args.moe_every,
                    moe_capacity_factor=args.moe_capacity_factor, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                    moe_z_loss_coeff=args.moe_z_loss_coeff, tie_word_embeddings=args.tie_word_embeddings)
    return cfg


def make_optimizer(args, hyb, grid):
    """AdamW over this rank's parameters; with ``--zero 1`` its state split over the data replicas (ZeRO-1)."""
    options = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    if not args.zero:
        return AdamW(hyb.parameters(), **options)
    from axonmpi.parallel.grad_sync import data_reduction_group
    group = data_reduction_group(grid)
    if group.size == 1:
        axonmpi.log.exit0("--zero 1 does nothing with one data replica (dp=1): it splits the optimizer state over "
                          "the data ranks; leave it out or add data parallelism")
    return ZeroRedundancyOptimizer(hyb.parameters(), AdamW, group=group, **options)


def log_to_run_folder(log, folder: str) -> None:
    """Rank 0's log lines also appended to ``folder/train.log`` (the run folder keeps its own log)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.abspath(os.path.join(folder, "train.log"))
    h = logging.FileHandler(path, encoding="utf-8")
    h._run_folder = True
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%Y-%m-%dT%H:%M:%S"))
    log.addHandler(h)
    atexit.register(h.close)


def detach_run_log(log) -> None:
    """Close the run-folder log of an earlier ``main()`` in this process (tests call it more than once)."""
    for h in [h for h in log.handlers if getattr(h, "_run_folder", False)]:
        log.removeHandler(h)
        h.close()


def count_parameters(hyb) -> int:
    """The serial model's parameter count (each rank's names with their full shapes, united over the ranks)."""
    from axonmpi.distributed import all_gather_object
    mine = {n: int(np.prod(shape)) for n, shape in hyb.full_shapes().items()}
    every = {}
    for d in all_gather_object(mine):
        every.update(d)
    return sum(every.values())


# dense matrix peak TFLOP/s of one GPU by name: (float32 without TF32, bfloat16/float16 tensor cores)
PEAK_TFLOPS = {"H200": (67.0, 989.0), "H100": (67.0, 989.0), "A100": (19.5, 312.0), "V100": (15.7, 125.0),
               "MI250X": (47.9, 383.0), "MI300X": (163.4, 1307.0), "L40S": (91.6, 362.0)}


def detect_peak_tflops(args) -> Optional[float]:
    """``--peak-tflops``, else the GPU's datasheet peak for the compute dtype (``PEAK_TFLOPS``), else None (CPU)."""
    if args.peak_tflops is not None:
        return args.peak_tflops
    from axonmpi import backend
    if os.environ.get("AXONMPI_DEVICE", "cpu").startswith("cpu") or not backend.cupy_available():
        return None
    cp = backend.get_cupy()
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    half = args.mixed_precision in ("fp16", "bf16")
    for key, (f32, f16) in PEAK_TFLOPS.items():
        if key in name:
            return f16 if half else f32
    return None


class Meter:
    """Step time, tokens/s (this step's and a moving average), MFU, peak memory, data position and wall time:
    the fields of every log line, the bar and ``--metrics-json``."""

    def __init__(self, args, world, cfg, n_params: int, log):
        self.tokens_per_step = args.global_batch * args.block_size
        # nanoGPT's estimate (PaLM appendix B): 6 N per token for the matrices, 12 L C T for the attention scores
        self.flops_per_token = 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * args.block_size
        peak = detect_peak_tflops(args)
        self.peak = None if peak is None else peak * 1e12 * world.world_size
        self.avg_dt = None
        self.steps_seen = 0
        self.tokens = 0
        self.replicas = None
        if self.peak is None:
            log.info("MFU not shown: no --peak-tflops and no GPU detected (pass the device's peak TFLOP/s per rank)")

    def update(self, dt: float, step: int, sampler) -> dict:
        """This step's numbers as a ``--metrics-json`` row's fields."""
        # the average (EMA 0.9) leaves out a run's first step (start-up: first calls, caches, the pipeline's warm-up),
        # which would weigh on it for tens of steps
        self.steps_seen += 1
        if self.steps_seen == 2 or self.avg_dt is None:
            self.avg_dt = dt
        else:
            self.avg_dt = 0.9 * self.avg_dt + 0.1 * dt
        row = {"step_s": dt, "tokens_per_s": self.tokens_per_step / max(dt, 1e-12),
               "tokens_per_s_avg": self.tokens_per_step / max(self.avg_dt, 1e-12)}
        if self.peak is not None:
            row["mfu"] = self.flops_per_token * row["tokens_per_s_avg"] / self.peak
        row["host_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # KiB on Linux
        dev = axonmpi.cuda.max_memory_allocated()
        if dev:
            row["device_gib"] = dev / 2 ** 30
        row.update(epoch=sampler.epoch, sample=sampler.consumed * sampler.num_replicas,
                   tokens=step * self.tokens_per_step,
                   time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        return row

    @staticmethod
    def short(row: dict) -> dict:
        """The bar's postfix fields."""
        out = {"step_s": f"{row['step_s']:.2f}", "tok_s": f"{row['tokens_per_s_avg']:,.0f}",
               "now": f"{row['tokens_per_s']:,.0f}"}
        if "mfu" in row:
            out["mfu"] = f"{100 * row['mfu']:.1f}%"
        out["rss"] = f"{row['host_peak_rss_gib']:.2f}G"
        if "device_gib" in row:
            out["gpu"] = f"{row['device_gib']:.1f}G"
        out["data"] = f"e{row['epoch']}:{row['sample']}"
        return out

    @staticmethod
    def line(row: dict) -> str:
        """The log line's tail."""
        mfu = f" | MFU {100 * row['mfu']:.1f}%" if "mfu" in row else ""
        dev = f", device {row['device_gib']:.2f} GiB" if "device_gib" in row else ""
        return (f"{row['step_s']:.3f} s/step, {row['tokens_per_s']:,.0f} tokens/s ({row['tokens_per_s_avg']:,.0f} "
                f"averaged){mfu} | peak RSS {row['host_peak_rss_gib']:.2f} GiB{dev} | epoch {row['epoch']} sample "
                f"{row['sample']}, {row['tokens']:,} tokens | {row['time']}")


def main(argv=None):
    args = parse_args(argv)
    sizes = dict(G_data=args.G_data, G_inter=args.G_inter, G_intra_r=args.G_intra_r, G_intra_c=args.G_intra_c,
                 G_intra_d=args.G_intra_d, G_context=args.context_parallel)
    world = axonmpi.get_world() if axonmpi.is_initialized() else None
    if world is None or any(v not in (None, 1) for v in sizes.values()):
        try:
            world = axonmpi.init(**sizes)
        except ValueError as e:
            axonmpi.log.exit0(f"impossible layout: {e}")
    grid = axonmpi.get_grid()
    log = axonmpi.get_logger("train_gpt", rank0_only=True)
    detach_run_log(log)
    if args.trace and axonmpi.trace.active() is None:
        axonmpi.trace.start(args.trace, world.rank)     # written when the run ends (or fails)
        atexit.register(axonmpi.trace.stop)
    pure_dp = grid.G_data == world.world_size
    if pure_dp and args.global_batch % world.world_size:
        n = world.world_size
        axonmpi.log.exit0(f"--global-batch {args.global_batch} must divide by the {n} ranks "
                          f"(e.g. --global-batch {max(n, args.global_batch // n * n)})")
    dtype = np.dtype(args.dtype)

    data = load_data(args)
    train_ds, val_tokens, h_unigram = data.train, data.val, data.h_unigram
    hf = read_init_from(args) if args.init_from else None
    if args.expert_parallel > 1 and (not args.moe_experts or grid.G_data % args.expert_parallel
                                     or args.moe_experts % args.expert_parallel):
        axonmpi.log.exit0(f"--expert-parallel {args.expert_parallel} needs --moe-experts and must divide both "
                          f"--G-data ({grid.G_data}) and --moe-experts ({args.moe_experts})")
    if grid.expert_parallel != args.expert_parallel:      # the expert groups are built with a grid, at its init
        grid = axonmpi.ProcessGrid(world, **grid.sizes, expert_parallel=args.expert_parallel)
    try:
        cfg = model_config(args, grid, data.vocab_size, hf)
    except ValueError as e:
        axonmpi.log.exit0(str(e))
    try:
        check_layout(cfg, Layout.from_grid(grid), global_batch=args.global_batch, num_microbatches=args.microbatches,
                     schedule=args.schedule, tp_style=args.tp_style, world_size=world.world_size,
                     sequence_parallel=args.sequence_parallel, virtual_stages=args.virtual_stages)
    except ValueError as e:
        axonmpi.log.exit0(str(e))
    chunks = 2 * args.context_parallel if args.cp_algo == "ring" else args.context_parallel
    if args.context_parallel > 1 and args.block_size < chunks:
        axonmpi.log.exit0(f"--block-size {args.block_size} cannot be cut into the {chunks} chunks --cp-algo "
                          f"{args.cp_algo} needs over --context-parallel {args.context_parallel} ranks; use "
                          f"--block-size >= {chunks}")
    if world.rank == 0:
        print(grid.describe(), flush=True)
    # every rank reads the whole global batch (same order as one process) and keeps its rows
    loader = axonmpi.create_dataloader(train_ds, global_batch_size=args.global_batch, seed=args.seed,
                                       group=world.split(world.rank, name="self"))
    sampler = loader.sampler

    axonmpi.manual_seed(args.seed)
    try:
        hyb = HybridGPT(cfg, grid, tp_style=args.tp_style, schedule=args.schedule,
                        num_microbatches=args.microbatches, activation_checkpointing=args.activation_checkpointing,
                        dtype=dtype, global_batch=args.global_batch,
                        fsdp="no_shard" if args.mixed_precision == "bf16" and args.fsdp == "none" else args.fsdp,
                        cpu_offload="full" if args.cpu_offload else None,
                        mixed_precision=_mixed_precision(args.mixed_precision),
                        hybrid_shard_size=args.hybrid_shard_size, cp_algo=args.cp_algo,
                        sequence_parallel=args.sequence_parallel, expert_parallel=args.expert_parallel,
                        virtual_stages=args.virtual_stages)
    except (NotImplementedError, ValueError) as e:     # a combination not built, found the same way on every rank
        axonmpi.log.exit0(str(e))
    scaler = (GradScaler(init_scale=args.init_loss_scale, growth_interval=args.loss_scale_growth_interval)
              if args.mixed_precision == "fp16" else None)
    opt = make_optimizer(args, hyb, grid)
    model, opt_state = hyb.checkpoint_state(opt)
    sched = LinearWarmupCosine(opt, warmup_steps=min(args.warmup, args.steps // 2), total_steps=max(args.steps, 1),
                               min_lr=args.lr * 0.1)
    axonmpi.manual_seed(hyb.dropout_seed(args.seed))  # one stream per row slice for dropout and sampling

    mgr, latest = open_checkpoints(args, world, log)
    if mgr is not None and not args.no_save and world.rank == 0:      # the log lines go into the run folder too
        log_to_run_folder(log, args.checkpoint_dir)
    step = 0
    mem, in_memory = open_memory_checkpoints(args, mgr, log)     # [memory checkpoints]
    if in_memory is not None:     # the newest step complete in node memory (own node or buddy): a lost node costs a step
        step = resume(in_memory, args, world, log, model, opt_state, sched, sampler, scaler)
        in_memory.close()
        latest = in_memory
    elif latest is not None:   # the newest intact checkpoint; ones failing verification are moved aside, saying so
        try:
            found = mgr.load_newest_intact(
                lambda path: resume(path, args, world, log, model, opt_state, sched, sampler, scaler))
        except ckpt.CheckpointError as e:   # every checkpoint damaged, or one that does not fit: never step 0
            axonmpi.log.exit0(f"{'--resume' if args.resume else '--auto-resume'}: {e}", code=1)
        step = 0 if found is None else found[1]
    if mem is not None and latest is not None:
        mem.discard_after(step)    # copies newer than the resumed step belong to a lost future
    elif hf is not None:       # a fresh fine-tune: the Hugging Face weights, the vocabulary padded for this layout
        hyb.load_full_state_dict(hf.state_dict)
        log.info("--init-from %s: %s weights loaded (vocabulary %d%s)", args.init_from, hf.kind, cfg.vocab_size,
                 f", padded to {cfg.vocab_rows} rows for the layout" if getattr(cfg, "padded_vocab_size", None) else "")
    hf = None             # the serial copy of the weights is not kept
    saving = mgr is not None and not args.no_save
    log.info("%s", hyb.describe())
    preempt = ckpt.PreemptionHandler() if saving and not args.no_preemption_save else None
    last_saved = step

    def save(step, async_save=False):
        extra = checkpoint_extra(args, cfg, hyb, scaler)
        nonlocal last_saved
        path = mgr.save(step, ckpt.training_state(model, opt_state, sched, sampler, step=step, extra=extra),
                        async_save=async_save)
        last_saved = step
        log.info("checkpoint %s %s (step %d; continue with --resume)",
                 "being written in the background to" if async_save else "saved to", path, step)
        return path

    n_params = count_parameters(hyb)
    log.info("%s (rank 0 trains %.2fM parameters of %.2fM) | %d ranks, %d row slices x %d sequences x %d %s | %d "
             "steps | %s, vocab %d, unigram entropy %.3f nats", hyb.recipe.name,
             sum(int(np.prod(q.shape)) for q in hyb.parameters()) / 1e6, n_params / 1e6, world.world_size, hyb.shards,
             args.global_batch // hyb.shards, args.block_size, data.unit, args.steps, data.describe,
             cfg.vocab_size, h_unigram)
    meter = Meter(args, world, cfg, n_params, log)

    bar = None
    # rank 0's bar where its stderr reaches a terminal, also through mpiexec (the launcher's stderr); never
    # \r updates in a batch log; --progress / --no-progress force it either way
    progress = args.progress or (not args.no_progress and world.rank == 0 and axonmpi.log.stderr_is_terminal())
    if world.rank == 0 and progress and step < args.steps:
        from tqdm import tqdm
        # rank 0's stderr, which mpiexec/srun forward to the launcher's stderr unbuffered
        bar = tqdm(total=args.steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                   file=sys.stderr, mininterval=0.5, disable=False)
    if args.metrics_json is None and saving:         # the run folder keeps its metrics: axonmpi plot RUN_FOLDER
        args.metrics_json = os.path.join(args.checkpoint_dir, "metrics.jsonl")
    metrics = (open_metrics(args.metrics_json, step, latest is not None, log)
               if (args.metrics_json and world.rank == 0) else None)
    start_step = step
    t0, t_last, loss_ema, lval = time.perf_counter(), time.perf_counter(), None, None
    it = None
    while step < args.steps:
        if it is None:
            it = iter(loader)
        try:
            x, y = next(it)
        except StopIteration:
            sampler.set_epoch(sampler.epoch + 1)
            it = None
            continue
        sampler.advance(len(x))
        opt.zero_grad()
        lval = hyb.forward_backward(hyb.local_batch(x), hyb.local_batch(y), scaler=scaler)  # mean over the batch
        if scaler is not None:
            scaler.unscale_(opt)
        grad_norm = hyb.clip_grad_norm_(args.grad_clip if args.grad_clip > 0 else float("inf"))
        if scaler is None and not (math.isfinite(lval) and math.isfinite(grad_norm)):   # before the step: name the rank
            check_finite(step + 1, loss=hyb.local_loss, optimizer=opt, reduced=(lval, grad_norm), hint="lower --lr")
        lr = opt.param_groups[0]["lr"]
        if scaler is not None:
            scaler.step(opt)           # skipped (and the scale halved) when a gradient overflowed
            scaler.update()
        else:
            opt.step()
        sched.step()
        step += 1
        if math.isfinite(lval) or loss_ema is None:   # a step the scaler skipped keeps the average (no scaler: raised)
            loss_ema = lval if loss_ema is None or not math.isfinite(loss_ema) else 0.9 * loss_ema + 0.1 * lval
        now = time.perf_counter()
        stats = meter.update(now - t_last, step, sampler)
        if metrics is not None:
            row = {"step": step, "loss": lval, "grad_norm": float(grad_norm), "lr": lr, **stats}
            if scaler is not None:
                row["loss_scale"] = scaler.get_scale()     # after this step's update
            if args.moe_experts:      # global batch: aux_loss, z_loss, tokens_per_expert_{min,mean,max}, dropped_tokens
                row.update(axonmpi.nn.moe_stats(hyb.model))
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
        if bar is not None:     # loss: this step's (the global batch's mean); loss_ema: its moving average
            bar.set_postfix(loss=f"{lval:.3f}", loss_ema=f"{loss_ema:.3f}", lr=f"{lr:.1e}", **meter.short(stats),
                            refresh=False)
            bar.update(1)
        elif step % args.log_every == 0 or step == args.steps:
            log.info("step %d/%d loss %.4f (moving average %.4f) lr %.2e | %s", step, args.steps, lval,
                     loss_ema, lr, meter.line(stats))
        t_last = now
        if saving and args.save_every and step % args.save_every == 0 and step < args.steps:
            save(step, async_save=args.async_save)
        if mem is not None and mem.should_save(step):   # [memory checkpoints] copy into node memory, send to the buddy
            mem.save(step, ckpt.training_state(model, opt_state, sched, sampler, step=step, rng=False,
                                               extra=checkpoint_extra(args, cfg, hyb, scaler)))
        if preempt is not None and preempt.should_stop():   # one 1-byte all-reduce per step
            t_stop = time.perf_counter()
            mgr.wait()              # a background save in flight completes first
            if last_saved != step:
                save(step)
            if metrics is not None:
                metrics.close()
            if mem is not None:
                mem.close()         # saved to the checkpoint: the memory copies go
            preempt.exit(f"saved step {step} of {args.steps} in {time.perf_counter() - t_stop:.1f} s")
    if bar is not None:
        bar.close()
    if metrics is not None:
        metrics.close()
    elapsed = time.perf_counter() - t0

    val = (evaluate(hyb, val_tokens, args.block_size, args.eval_batches, args.global_batch, args.seed)
           if args.eval_batches else None)      # --eval-batches 0: no held-out forwards
    held_out = ("no held-out evaluation (--eval-batches 0)" if val is None else
                f"held-out loss {val:.3f} vs unigram entropy {h_unigram:.3f} nats ("
                + (f"learned structure beyond {data.unit[:-1]} frequencies" if val < h_unigram
                   else "not yet below unigram") + ")")
    log.info("done: step %d (%d this run) in %.1f s | train loss %s (last step's; moving average %s) | %s", step,
             step - start_step, elapsed, "n/a" if lval is None else f"{lval:.4f}",
             "n/a" if loss_ema is None else f"{loss_ema:.4f}", held_out)
    if saving and step > start_step:
        save(step)
    if mgr is not None:
        mgr.release()   # waits for a background save
    if mem is not None:
        mem.close()         # a clean end: this run's memory copies go
    if preempt is not None:
        preempt.close()
    if args.dump_params:
        full = hyb.full_state_dict()
        if world.rank == 0:
            np.savez(args.dump_params, **full)
    if args.sample_chars > 0 and hyb.ddp is None:
        log.info("no sample: generation needs the whole model on one rank (pure data parallel layouts with "
                 "--fsdp none)")
    elif args.sample_chars > 0 and (world.rank == 0 or args.expert_parallel > 1):
        # expert parallel: every rank runs the generation (its forwards dispatch tokens to the others)
        idx = data.prompt[None, :]
        out = hyb.generate(idx, args.sample_chars, temperature=0.8, top_k=20)
        if world.rank == 0:
            print("---- sample ----\n" + data.decode(out[0]) + "\n----------------", flush=True)
    axonmpi.barrier()


if __name__ == "__main__":
    main()
