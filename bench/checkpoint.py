"""Checkpoint save/load throughput beside raw h5py writing the same bytes from the same ranks.

Run at several world sizes:

    mpiexec -n 1 python bench/checkpoint.py
    mpiexec -n 2 python bench/checkpoint.py
    mpiexec -n 4 python bench/checkpoint.py --mib 256

The state is a GPT-like model of ``--mib`` MiB of float32 (embedding, per-layer qkv/proj/fc
matrices sharded along axis 0 over the ranks as ShardedArray, FSDP-style; biases and norms
replicated). "raw" is each rank writing its own blocks to its own file with h5py directly (no
checksums, no index, no rename) and reading them back with ``read_direct``. Both run in the
same invocation on the same files system, alternating, best of ``--repeats``. Loads read from
the page cache (files were just written); save is shown with and without fsync for both.
"load" is the default, verified load (every 4 MiB block's xxh3_64 checksum compared before the
data is handed back); "load verify=F" skips the comparison. The target for the verified load is
>= 0.8x raw at 1, 2 and 4 ranks.

"replication check" is the cost of the always-on proof that plain (non-ShardedArray) arrays are
replicated: every plain array's xxh3_64 digest, computed in the save's plan (the digests travel
with the plan in the one collective the save already does). It is timed on this state (biases
and norms plain) and on the worst case, a state whose every array is plain (a DDP checkpoint).

A second table is the training stall of a save, as ``CheckpointManager.save`` sees it: the time
until the call returns (the slowest rank). "sync" is the default durable save; "async" is
``async_save=True`` (copy into reused host buffers, write in a background thread), timed after one
warm-up save (which allocates the buffers); "host copy" is ``np.copyto`` of the same arrays into
preallocated buffers, the floor of any async save; "background write" is the ``wait()`` that follows.
Goals: async stall <= 1.2x the host copy, and >= 5x below the sync stall.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import sys

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import axonmpi  # noqa: E402
from axonmpi.checkpoint import CheckpointManager, ShardedArray, load, save  # noqa: E402


def model_state(mib: int, group) -> dict:
    d = 1024
    per_layer = 12 * d * d + 9 * d  # qkv 3d², proj d², fc1 4d², fc2 4d² + biases/norms
    vocab = 8192
    layers = max(1, round((mib * 2**20 / 4 - vocab * d) / per_layer))

    def sharded(shape):
        return ShardedArray.zeros(shape, np.float32, axis=0, group=group)

    st = {"embed.weight": sharded((vocab, d))}
    for i in range(layers):
        p = f"blocks.{i}."
        st[p + "attn.qkv.weight"] = sharded((3 * d, d))
        st[p + "attn.qkv.bias"] = np.zeros(3 * d, np.float32)
        st[p + "attn.proj.weight"] = sharded((d, d))
        st[p + "mlp.fc1.weight"] = sharded((4 * d, d))
        st[p + "mlp.fc2.weight"] = sharded((d, 4 * d))
        st[p + "ln1.weight"] = np.ones(d, np.float32)
        st[p + "ln2.weight"] = np.ones(d, np.float32)
    for i, v in enumerate(st.values()):  # replicated arrays equal on every rank, shards differ
        a = v.local if isinstance(v, ShardedArray) else v
        rng = np.random.default_rng([i, group.rank if isinstance(v, ShardedArray) else 0])
        a[...] = rng.standard_normal(a.shape, dtype=np.float32)
    return {"model": st, "step": 1000}


def raw_pieces(state: dict, group) -> dict:
    """What this rank writes raw: its sharded blocks, and the replicated arrays on rank 0."""
    out = {}
    for k, v in state["model"].items():
        if isinstance(v, ShardedArray):
            out[k] = v.local
        elif group.rank == 0:
            out[k] = v
    return out


def raw_save(path: str, arrays: dict, fsync: bool) -> None:
    with h5py.File(path, "w") as f:
        for k, a in arrays.items():
            f.create_dataset(k, data=a)
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def raw_load(path: str, arrays: dict) -> None:
    with h5py.File(path, "r") as f:
        for k, a in arrays.items():
            f[k].read_direct(a)


def timed(group, fn) -> float:
    group.barrier()
    t = time.perf_counter()
    fn()
    group.barrier()
    return axonmpi.all_reduce(np.array(time.perf_counter() - t), op="max", group=group).item()


def stall_bench(state: dict, base: str, g, repeats: int) -> dict:
    """Best stall (slowest rank) of a sync save, an async save, its background write, and a bare host copy."""
    mgr = CheckpointManager(os.path.join(base, "managed"), keep_last=1, group=g)
    arrays = [v.local if isinstance(v, ShardedArray) else v for v in state["model"].values()]
    bufs = [np.empty_like(a) for a in arrays]

    def copy():
        for b, a in zip(bufs, arrays):
            np.copyto(b, a)

    mgr.save(0, state, async_save=True)   # warm-up: the host buffers and the writer's group are made once
    mgr.wait()
    best, step = {}, 1
    for _ in range(repeats):
        for name, fn in (("host copy", copy), ("sync save (fsync)", lambda: mgr.save(step, state)),
                         ("async save", lambda: mgr.save(step, state, async_save=True)),
                         ("async: background write", mgr.wait)):
            t = timed(g, fn)
            best[name] = min(best.get(name, t), t)
            step += name.endswith("save") or name.endswith("(fsync)")
    mgr.release()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB (float32)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    world = axonmpi.init()
    g = world.default_group
    base = args.dir or (tempfile.mkdtemp(prefix="axonmpi-bench-ckpt-") if g.rank == 0 else None)
    base = axonmpi.broadcast_object(base)
    state = model_state(args.mib, g)
    mine = raw_pieces(state, g)
    total = axonmpi.all_reduce(np.array(sum(a.nbytes for a in mine.values()), np.int64)).item()
    ck = os.path.join(base, "ck")
    raw_dir = os.path.join(base, "raw")
    if g.rank == 0:
        os.makedirs(raw_dir, exist_ok=True)
    g.barrier()
    raw_file = os.path.join(raw_dir, f"rank{g.rank}.h5")
    template = {"model": {k: (ShardedArray(np.empty_like(v.local), v.global_shape, v.offsets)
                              if isinstance(v, ShardedArray) else np.empty_like(v))
                          for k, v in state["model"].items()}, "step": 0}
    raw_out = {k: np.empty_like(a) for k, a in mine.items()}

    best = {}
    for _ in range(args.repeats):
        for fsync in (False, True):
            for name, fn in ((f"raw save{' +fsync' if fsync else ''}", lambda: raw_save(raw_file, mine, fsync)),
                             (f"axonmpi save{' +fsync' if fsync else ''}", lambda: save(ck, state, fsync=fsync))):
                t = timed(g, fn)
                best[name] = min(best.get(name, t), t)
        for name, fn in (("raw load", lambda: raw_load(raw_file, raw_out)),
                         ("axonmpi load", lambda: load(ck, template)),
                         ("axonmpi load noverify", lambda: load(ck, template, verify=False))):
            t = timed(g, fn)
            best[name] = min(best.get(name, t), t)
    from axonmpi.checkpoint.plan import plan_state
    all_plain = {"model": {k: (v.local if isinstance(v, ShardedArray) else v) for k, v in state["model"].items()}}
    for name, st in (("plan", state), ("plan all plain", all_plain)):
        for _ in range(args.repeats):
            t = timed(g, lambda: plan_state(st, g.rank))
            best[name] = min(best.get(name, t), t)
    plain_bytes = sum(v.nbytes for v in state["model"].values() if not isinstance(v, ShardedArray))
    stall = stall_bench(state, base, g, args.repeats)
    for k, a in raw_out.items():  # the bench also checks what it timed
        np.testing.assert_array_equal(a, mine[k])
    for k, v in state["model"].items():
        np.testing.assert_array_equal(template["model"][k].local if isinstance(v, ShardedArray) else template["model"][k],
                                      v.local if isinstance(v, ShardedArray) else v)

    if g.rank == 0:
        n = len(state["model"])
        print(f"checkpoint bench: {world.world_size} rank(s), {n} entries, {total / 2**20:.0f} MiB float32 "
              f"(best of {args.repeats}), dir {base}")
        from axonmpi.checkpoint.checksum import CHECKSUM_ALGORITHM
        print(f"load verifies every block ({CHECKSUM_ALGORITHM}); load verify=F does not")
        print(f"{'operation':<14} {'raw h5py GB/s':>14} {'axonmpi GB/s':>13} {'ratio':>7}")
        for op, rk, ak in (("save", "raw save", "axonmpi save"), ("save +fsync", "raw save +fsync", "axonmpi save +fsync"),
                           ("load", "raw load", "axonmpi load"),
                           ("load verify=F", "raw load", "axonmpi load noverify")):
            r, a = total / best[rk] / 1e9, total / best[ak] / 1e9
            print(f"{op:<14} {r:>14.2f} {a:>13.2f} {a / r:>6.2f}x")
        for name, nbytes in (("plan", plain_bytes), ("plan all plain", sum(a.nbytes for a in mine.values()))):
            print(f"replication check ({name}: {nbytes / 2**20:.1f} MiB hashed per rank): "
                  f"{best[name] * 1e3:.1f} ms = {100 * best[name] / best['axonmpi save']:.1f}% of a save")
        print(f"\ntraining stall of one save of the {total / 2**20:.0f} MiB state (best of {args.repeats})")
        print(f"{'save':<26} {'stall ms':>9} {'vs host copy':>13} {'sync / this':>12}")
        for name in ("sync save (fsync)", "host copy", "async save", "async: background write"):
            t = stall[name]
            print(f"{name:<26} {t * 1e3:>9.1f} {t / stall['host copy']:>12.2f}x "
                  f"{stall['sync save (fsync)'] / t:>11.1f}x")
    g.barrier()
    if g.rank == 0 and args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
