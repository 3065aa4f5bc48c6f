"""Train a character-level GPT on the Python standard library's own source code, data parallel over MPI ranks.

Run on 4 local ranks (what `make demo` does):

    mpiexec -n 4 python examples/train_gpt.py
    mpiexec -n 4 python examples/train_gpt.py --resume          # continue from the last checkpoint

Each rank holds the whole model (DistributedDataParallel); the global batch is split across
ranks, gradients are averaged with bucketed all-reduces overlapped with backward. Rank 0
shows a progress bar (loss, tokens/s, ETA), evaluates on held-out text, prints a generated
sample, and a sharded HDF5 checkpoint is written at the end (and every --save-every steps).
"""
import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import axonmpi  # noqa: E402
from axonmpi import checkpoint as ckpt  # noqa: E402
from axonmpi.data import CharDataset, CharTokenizer, load_stdlib_corpus, unigram_entropy  # noqa: E402
from axonmpi.models import GPT, GPTConfig  # noqa: E402
from axonmpi.optim import AdamW, clip_grad_norm_  # noqa: E402
from axonmpi.optim.lr_scheduler import LinearWarmupCosine  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--n-layer", type=int, default=4, help="transformer blocks (default 4)")
    g.add_argument("--n-head", type=int, default=4, help="attention heads (default 4)")
    g.add_argument("--n-embd", type=int, default=128, help="width; must divide by --n-head (default 128)")
    g.add_argument("--block-size", type=int, default=64, help="context length in characters (default 64)")
    g.add_argument("--dropout", type=float, default=0.0, help="dropout probability (default 0)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps in total (default 300)")
    g.add_argument("--global-batch", type=int, default=32,
                   help="sequences per step over all ranks; must divide by the number of ranks (default 32)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    g.add_argument("--warmup", type=int, default=20, help="linear warmup steps (default 20)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default 0.01)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm; 0 disables")
    g.add_argument("--seed", type=int, default=0, help="seed of init, data order and sampling (default 0)")
    g.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    g = p.add_argument_group("data")
    g.add_argument("--corpus-bytes", type=int, default=1 << 20,
                   help="bytes of standard-library source to train on (default 1 MiB)")
    g.add_argument("--eval-batches", type=int, default=8, help="held-out batches for the final evaluation")
    g = p.add_argument_group("output")
    g.add_argument("--sample-chars", type=int, default=200, help="characters to generate at the end (0: none)")
    g.add_argument("--checkpoint-dir", default="checkpoints/gpt", help="where checkpoints go")
    g.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    g.add_argument("--keep-last", type=int, default=2, help="checkpoints kept (default 2)")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    g.add_argument("--auto-resume", action="store_true",
                   help="continue from the latest checkpoint if there is one, else start fresh (for re-submitted jobs)")
    g.add_argument("--no-save", action="store_true", help="write no checkpoint")
    g.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    return p.parse_args(argv)


def evaluate(model, tokens, block, batches, batch, seed):
    """Mean loss on ``batches`` random windows of the held-out tokens (each rank its own share)."""
    world = axonmpi.get_world()
    rng = np.random.default_rng((seed, 99, world.rank))
    ds = CharDataset(tokens, block)
    model.eval()
    losses = []
    with axonmpi.no_grad():
        for _ in range(batches):
            idx = rng.integers(0, len(ds), batch)
            x, y = ds.get_batch(idx)
            _, loss = model.module(x, y)
            losses.append(float(loss.item()))
    model.train()
    return float(axonmpi.all_reduce_mean(np.array(np.mean(losses))))


def main(argv=None):
    args = parse_args(argv)
    world = axonmpi.init()
    log = axonmpi.get_logger("train_gpt", rank0_only=True)
    if args.global_batch % world.world_size:
        raise SystemExit(f"--global-batch {args.global_batch} must divide by the {world.world_size} ranks")
    dtype = np.dtype(args.dtype)

    text = load_stdlib_corpus(max_bytes=args.corpus_bytes)
    tok = CharTokenizer(text)
    data = tok.encode(text)
    split = int(0.9 * len(data))
    train_tokens, val_tokens = data[:split], data[split:]
    h_unigram = unigram_entropy(train_tokens)
    train_ds = CharDataset(train_tokens, args.block_size)
    loader = axonmpi.create_dataloader(train_ds, global_batch_size=args.global_batch, seed=args.seed)
    sampler = loader.sampler

    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    axonmpi.manual_seed(args.seed)
    model = axonmpi.DDP(GPT(cfg).to(dtype=dtype))
    opt = AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    sched = LinearWarmupCosine(opt, warmup_steps=min(args.warmup, args.steps // 2), total_steps=max(args.steps, 1),
                               min_lr=args.lr * 0.1)
    axonmpi.manual_seed(args.seed * 1000 + world.rank)  # per-rank stream for dropout and sampling

    mgr = None if args.no_save else ckpt.CheckpointManager(args.checkpoint_dir, keep_last=args.keep_last)
    step = 0
    latest = mgr.latest() if (mgr is not None and (args.resume or args.auto_resume)) else None
    if args.resume and latest is None:
        raise SystemExit(f"--resume: no checkpoint found in {args.checkpoint_dir!r}; run without --resume first")
    if latest is not None:
        loaded = ckpt.load(latest)
        meta = ckpt.restore_training_state(loaded, model=model, optimizer=opt, scheduler=sched, sampler=sampler)
        step = int(meta["step"])
        log.info("resumed from %s at step %d (saved on %s ranks)", latest, step, meta.get("world_size"))
        if step >= args.steps:
            log.info("nothing to do: checkpoint step %d >= --steps %d; raise --steps to train longer", step, args.steps)

    log.info("GPT %.2fM parameters | %d ranks x %d sequences x %d chars | %d steps | %d train chars, vocab %d, "
             "unigram entropy %.3f nats", model.module.num_parameters() / 1e6, world.world_size,
             args.global_batch // world.world_size, args.block_size, args.steps, len(train_tokens),
             tok.vocab_size, h_unigram)

    bar = None
    if world.rank == 0 and not args.no_progress and step < args.steps:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                   file=sys.stdout, mininterval=0.5)
    start_step = step
    tokens_per_step = args.global_batch * args.block_size
    t0, t_last, loss_ema = time.perf_counter(), time.perf_counter(), None
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
        _, loss = model(x, y)
        loss.backward()
        if args.grad_clip > 0:
            clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        sched.step()
        step += 1
        lval = float(loss.item())
        if not math.isfinite(lval):
            raise FloatingPointError(f"rank {world.rank}: loss became {lval} at step {step}; lower --lr")
        loss_ema = lval if loss_ema is None else 0.9 * loss_ema + 0.1 * lval
        now = time.perf_counter()
        if bar is not None:
            bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{tokens_per_step / max(now - t_last, 1e-9):,.0f}",
                            lr=f"{sched.get_last_lr()[0]:.1e}", refresh=False)
            bar.update(1)
        elif args.no_progress and world.rank == 0 and (step % 25 == 0 or step == args.steps):
            log.info("step %d/%d loss %.3f", step, args.steps, loss_ema)
        t_last = now
        if mgr is not None and args.save_every and step % args.save_every == 0 and step < args.steps:
            mgr.save(step, ckpt.training_state(model, opt, sched, sampler, step=step, extra={"config": vars(args)}))
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t0

    val = evaluate(model, val_tokens, args.block_size, args.eval_batches, args.global_batch // world.world_size,
                   args.seed)
    log.info("done: step %d (%d this run) in %.1f s | train loss %s | held-out loss %.3f vs unigram entropy %.3f "
             "nats (%s)", step, step - start_step, elapsed, "n/a" if loss_ema is None else f"{loss_ema:.3f}", val,
             h_unigram,
             "learned structure beyond character frequencies" if val < h_unigram else "not yet below unigram")
    if mgr is not None and step > start_step:
        path = mgr.save(step, ckpt.training_state(model, opt, sched, sampler, step=step,
                                                   extra={"config": vars(args)}))
        log.info("checkpoint saved to %s (resume with --resume)", path)
    if args.sample_chars > 0 and world.rank == 0:
        prompt = "def "
        idx = tok.encode(prompt)[None, :]
        out = model.module.generate(idx, args.sample_chars, temperature=0.8, top_k=20)
        print("---- sample ----\n" + tok.decode(out[0]) + "\n----------------", flush=True)
    axonmpi.barrier()


if __name__ == "__main__":
    main()
