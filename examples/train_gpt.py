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
import json
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


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default shown."""


# options that fix the model's shapes (or its vocabulary): a resume must use the saved values
ARCH_OPTIONS = ("n_layer", "n_head", "n_embd", "block_size", "corpus_bytes", "dtype")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    g.add_argument("--n-head", type=int, default=4, help="attention heads")
    g.add_argument("--n-embd", type=int, default=128, help="width; must divide by --n-head")
    g.add_argument("--block-size", type=int, default=64, help="context length in characters")
    g.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
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
    g = p.add_argument_group("data")
    g.add_argument("--corpus-bytes", type=int, default=1 << 20, help="bytes of standard-library source to train on")
    g.add_argument("--eval-batches", type=int, default=8, help="held-out batches for the final evaluation")
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
    g = p.add_argument_group("output")
    g.add_argument("--sample-chars", type=int, default=200, help="characters to generate at the end (0: none)")
    g.add_argument("--no-progress", action="store_true",
                   help="log lines instead of a progress bar (automatic when stdout is not a terminal)")
    g.add_argument("--log-every", type=int, default=25, help="a log line every N steps without a progress bar")
    g.add_argument("--metrics-json", default=None, metavar="PATH",
                   help="append one JSON line per step (step, loss, grad_norm, lr, tokens_per_s); rank 0 writes")
    args = axonmpi.log.rank0_parser(p).parse_args(argv)
    for name in ("steps", "global_batch", "log_every", "keep_last"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.overwrite and (args.resume or args.auto_resume):
        p.error("--overwrite starts fresh; it cannot be combined with --resume/--auto-resume")
    return args


def config_mismatch(saved: dict, args) -> list:
    """``["--n-embd 64 vs saved 128", ...]`` for every shape-defining option that differs from the checkpoint."""
    out = []
    for name in ARCH_OPTIONS:
        if name in saved and saved[name] != getattr(args, name):
            out.append(f"--{name.replace('_', '-')} {getattr(args, name)} vs saved {saved[name]}")
    return out


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


def open_checkpoints(args, world, log):
    """The CheckpointManager (None with --no-save and no resume) and the checkpoint to resume from (or None).

    A fresh run into a folder that already holds checkpoints stops with the choices
    (--resume, --overwrite, another --checkpoint-dir) instead of mixing two runs in one folder.
    """
    resuming = args.resume or args.auto_resume
    if args.no_save and not resuming:
        return None, None
    mgr = ckpt.CheckpointManager(args.checkpoint_dir, keep_last=args.keep_last)
    steps = axonmpi.broadcast_object(mgr.steps() if world.rank == 0 else None)
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
    return mgr, (mgr.path_for(steps[-1]) if resuming and steps else None)


def resume(path, args, world, log, model, opt, sched, sampler):
    """Restore the run saved at ``path``; check its config first; extend the LR schedule to ``--steps``."""
    loaded = ckpt.load(path)
    saved = (loaded.get("extra") or {}).get("config") or {}
    diff = config_mismatch(saved, args)
    if diff:
        axonmpi.log.exit0(f"{path} was saved with another model: {'; '.join(diff)}. Pass the saved values "
                          "to resume, or start a new run in another --checkpoint-dir")
    meta = ckpt.restore_training_state(loaded, model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    step = int(meta["step"])
    saved_ranks = int(meta.get("world_size", world.world_size))
    log.info("resumed from %s at step %d (saved on %d ranks)", path, step, saved_ranks)
    if saved_ranks != world.world_size:
        # a continuation of the random streams is impossible on another rank count: derive one
        # independent stream per rank from the seed and the step, the same way on every rank
        axonmpi.manual_seed(args.seed * 1000 + world.rank + 7919 * step)
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


def main(argv=None):
    args = parse_args(argv)
    world = axonmpi.init()
    log = axonmpi.get_logger("train_gpt", rank0_only=True)
    if args.global_batch % world.world_size:
        n = world.world_size
        axonmpi.log.exit0(f"--global-batch {args.global_batch} must divide by the {n} ranks "
                          f"(e.g. --global-batch {max(n, args.global_batch // n * n)})")
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

    mgr, latest = open_checkpoints(args, world, log)
    step = 0 if latest is None else resume(latest, args, world, log, model, opt, sched, sampler)
    saving = mgr is not None and not args.no_save

    def save(step):
        path = mgr.save(step, ckpt.training_state(model, opt, sched, sampler, step=step, extra={"config": vars(args)}))
        log.info("checkpoint saved to %s (step %d; continue with --resume)", path, step)
        return path

    log.info("GPT %.2fM parameters | %d ranks x %d sequences x %d chars | %d steps | %d train chars, vocab %d, "
             "unigram entropy %.3f nats", model.module.num_parameters() / 1e6, world.world_size,
             args.global_batch // world.world_size, args.block_size, args.steps, len(train_tokens),
             tok.vocab_size, h_unigram)

    bar = None
    progress = not args.no_progress and sys.stdout.isatty()  # no \r updates in batch logs
    if world.rank == 0 and progress and step < args.steps:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                   file=sys.stdout, mininterval=0.5)
    metrics = open(args.metrics_json, "a", encoding="utf-8") if (args.metrics_json and world.rank == 0) else None
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
        grad_norm = clip_grad_norm_(model.parameters(), args.grad_clip if args.grad_clip > 0 else float("inf"))
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        step += 1
        lval = float(loss.item())
        if not math.isfinite(lval):
            raise FloatingPointError(f"rank {world.rank}: loss became {lval} at step {step}; lower --lr")
        loss_ema = lval if loss_ema is None else 0.9 * loss_ema + 0.1 * lval
        now = time.perf_counter()
        tok_s = tokens_per_step / max(now - t_last, 1e-9)
        if args.metrics_json:
            mean_loss = float(axonmpi.all_reduce_mean(np.array(lval)))  # every rank: the all-reduce is collective
            if metrics is not None:
                metrics.write(json.dumps({"step": step, "loss": mean_loss, "grad_norm": float(grad_norm), "lr": lr,
                                          "tokens_per_s": tok_s}) + "\n")
                metrics.flush()
        if bar is not None:
            bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.1e}", refresh=False)
            bar.update(1)
        elif step % args.log_every == 0 or step == args.steps:
            log.info("step %d/%d loss %.3f lr %.2e %.0f tokens/s", step, args.steps, loss_ema, lr, tok_s)
        t_last = now
        if saving and args.save_every and step % args.save_every == 0 and step < args.steps:
            save(step)
    if bar is not None:
        bar.close()
    if metrics is not None:
        metrics.close()
    elapsed = time.perf_counter() - t0

    val = evaluate(model, val_tokens, args.block_size, args.eval_batches, args.global_batch // world.world_size,
                   args.seed)
    log.info("done: step %d (%d this run) in %.1f s | train loss %s | held-out loss %.3f vs unigram entropy %.3f "
             "nats (%s)", step, step - start_step, elapsed, "n/a" if loss_ema is None else f"{loss_ema:.3f}", val,
             h_unigram,
             "learned structure beyond character frequencies" if val < h_unigram else "not yet below unigram")
    if saving and step > start_step:
        save(step)
    if args.sample_chars > 0 and world.rank == 0:
        prompt = "def "
        idx = tok.encode(prompt)[None, :]
        out = model.module.generate(idx, args.sample_chars, temperature=0.8, top_k=20)
        print("---- sample ----\n" + tok.decode(out[0]) + "\n----------------", flush=True)
    axonmpi.barrier()


if __name__ == "__main__":
    main()
