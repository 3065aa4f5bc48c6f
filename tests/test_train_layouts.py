"""Every layout string ``axonmpi plan`` can print for 1, 2, 4 and 8 ranks, pasted into ``examples/train_gpt.py
--layout``, runs (issue 52: "the planner's answer cannot be pasted").

The strings are the planner's own (``planner.search.search``, what ``axonmpi plan ... --top N`` ranks and prints):
for a dense GPT of 8 and 6 layers (``vp`` = 2, 4 and 3), a Llama (grouped-query, gated MLP) and a MoE GPT of 4
experts (``ep``), on this machine's measured description (``--hardware cpu``: 4 ranks per node, so 8 ranks span
two nodes and hybrid shard appears) and on the default datasheet machine (``dgx-a100``: 8 per node, ``tp=8``),
with context parallelism up to the world (``--max-cp``) and AxoNN's row x col x depth.  (``axonmpi plan --overlap 0``
adds ``overlap=0`` to every string: a model of runtimes that reduce gradients after the backward, which the trainer
refuses naming it, since axonmpi always overlaps them: ``tests/test_train_data.py``.)  Each string is run for one
step of a tiny model of the shape the planner was given; the runs of one world size share one ``mpiexec`` (this
file is also the script each rank runs: ``train_gpt.main`` in a loop).

``test_a_representative_subset_runs`` (unmarked) runs every value of every key the planner prints at least once
(a greedy cover of the key=value pairs, 4 and 8 ranks); ``test_every_planner_layout_runs`` (slow) runs them all,
without the final held-out evaluation (``--eval-batches 0``: the subset keeps it).  The planner prints 1, 21, 178
and 883 strings for 1, 2, 4 and 8 ranks; all of 1, 2 and 4 run.  At 8 ranks all 883 ran one step on 2026-12-07
(docs/finetune.md has the record).  A string costs about
4.4 CPU-seconds over the 8 ranks (5.6 before the evaluation was skipped and the trainer's parameter count read
its state once), 1.5-3 s on the 2-core machine when it is quiet: the 30 s per string of the timeout is loose."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
WORLDS = (1, 2, 4, 8)
GLOBAL_BATCH, SEQ = 16, 16
# the planner's shapes and the trainer's flags for the same model
MODELS = {
    "gpt8": (dict(layers=8, width=32, heads=4, seq=SEQ, vocab=64), ["--n-layer", "8"]),
    "gpt6": (dict(layers=6, width=32, heads=4, seq=SEQ, vocab=64), ["--n-layer", "6"]),
    "llama8": (dict(layers=8, width=32, heads=4, seq=SEQ, vocab=64, ffn=64, kv_heads=2, gated=True, rotary=True,
                    bias=False), ["--model", "llama", "--n-layer", "8", "--n-kv-head", "2", "--ffn-hidden", "64"]),
    "moe8": (dict(layers=8, width=32, heads=4, seq=SEQ, vocab=64, experts=4, top_k=1),
             ["--n-layer", "8", "--moe-experts", "4"]),
}
COMMON = ["--n-embd", "32", "--n-head", "4", "--block-size", str(SEQ), "--global-batch", str(GLOBAL_BATCH),
          "--steps", "1", "--warmup", "0", "--no-save", "--sample-chars", "0", "--no-progress",
          "--corpus-bytes", "6000", "--make-vocab-size-divisible-by", "8"]


def planner_pairs(world: int) -> set:
    """``{(label, model)}``: every layout string the planner ranks for ``world`` ranks, with each model giving it."""
    from axonmpi.planner import TrainConfig, TransformerConfig
    from axonmpi.planner.hardware import load_hardware
    from axonmpi.planner.search import search
    train = TrainConfig(GLOBAL_BATCH, 1, "fp32", "none", dropout=False)
    out = set()
    for hw in ("cpu", "dgx-a100"):
        for name, (shape, _) in MODELS.items():
            for e in search(TransformerConfig(**shape), train, world, load_hardware(hw), memory_limit=float("inf"),
                            max_cp=world):
                out.add((e.layout.label(), name))
    return out


def planner_layouts(world: int) -> dict:
    """``{label: model}``: every string once, with the first of ``MODELS`` that gives it."""
    out = {}
    for label, model in sorted(planner_pairs(world), key=lambda p: (p[0], list(MODELS).index(p[1]))):
        out.setdefault(label, model)
    return out


def cover(pairs: set) -> dict:
    """A few ``{label: model}`` holding every ``key=value`` the planner prints and every model (greedy set cover)."""
    def items(p):
        return {"model=" + p[1]} | set(p[0].split(","))
    todo = set().union(*map(items, pairs)) if pairs else set()
    out = {}
    while todo:
        best = max(sorted(pairs), key=lambda p: (len(items(p) & todo), -len(p[0])))
        out[best[0]] = best[1]
        todo -= items(best)
    return out


def _argv(label: str, model: str, eval_batches: int = 1) -> list:
    return [*COMMON, *MODELS[model][1], "--eval-batches", str(eval_batches), "--layout", label]


def _run_all(world: int, labels: dict, tmp_path, eval_batches: int = 1) -> None:
    """Run ``labels`` (one step each, then ``eval_batches`` held-out batches) in one ``mpiexec -n world`` and fail
    naming every label that did not run."""
    import faulthandler
    from axonmpi.testing import run_mpiexec
    faulthandler.dump_traceback_later(60 + 30 * len(labels), exit=True, file=sys.__stderr__)   # per layout run
    todo, done = str(tmp_path / f"todo{world}.json"), str(tmp_path / f"done{world}.json")
    with open(todo, "w") as f:
        json.dump([[x, m, eval_batches] for x, m in sorted(labels.items())], f)
    r = run_mpiexec([os.path.abspath(__file__), todo, done], n=world, timeout=30 * len(labels), cwd=str(tmp_path))
    results = json.load(open(done)) if os.path.exists(done) else {}
    bad = {x: results.get(x, "not reached") for x in labels if results.get(x) != "ok"}
    assert r.returncode == 0 and not bad, (f"{len(bad)} of {len(labels)} layouts at {world} ranks did not run: "
                                           f"{json.dumps(bad, indent=1)[:6000]}\n{r.stderr[-3000:]}")


def test_the_planners_strings_cover_every_axis():
    """The enumeration is what the planner prints: every key it can print appears, and the trainer's parser takes
    every string (the runs below then take them for real)."""
    import train_gpt
    labels = {}
    for w in WORLDS:
        labels.update(planner_layouts(w))
    keys = {p.split("=")[0] for x in labels for p in x.split(",")}
    assert {"tp", "pp", "dp", "vp", "cp", "ep", "sp", "zero", "shard", "row", "col", "depth", "schedule",
            "cp_kind"} <= keys, keys
    assert {"vp=2", "vp=3", "vp=4", "tp=4", "schedule=zbv", "zero=3,shard=4"} <= \
        {p for x in labels for p in x.split(",")} | {",".join(x.split(",")[-2:]) for x in labels}
    for label, model in labels.items():
        train_gpt.parse_args(_argv(label, model))


@pytest.mark.serial
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 4, pytest.param(8, marks=pytest.mark.slow)])
def test_a_representative_subset_runs(world, tmp_path):
    """Every key=value pair the planner prints at this world size, in a few labels (14 at 4 ranks), runs one step;
    for each model (GPT, Llama, MoE GPT) its own pairs.  4 ranks in ``make test``; 2 and 8 in ``make test-all``."""
    _run_all(world, cover(planner_pairs(world)), tmp_path)


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("world", WORLDS)
def test_every_planner_layout_runs(world, tmp_path):
    """Every string the planner prints for ``world`` ranks runs one step (about a thousand at 8 ranks)."""
    _run_all(world, planner_layouts(world), tmp_path, eval_batches=0)


def _main(todo: str, done: str) -> None:
    """Each rank: ``train_gpt.main`` for every label of ``todo`` in turn; rank 0 records each outcome in ``done``."""
    import contextlib
    import io
    import logging
    import time
    import traceback

    import axonmpi
    import train_gpt
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    results = {}
    logging.disable(logging.INFO)       # one line per layout, not the trainer's log
    with open(todo, encoding="utf-8") as f:
        todo_rows = json.load(f)
    for label, model, eval_batches in todo_rows:
        err, t0 = io.StringIO(), time.perf_counter()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                train_gpt.main(_argv(label, model, eval_batches))
            outcome = "ok"
        except SystemExit as e:
            outcome = f"exit {e.code}: {err.getvalue()[-800:]}"
        except Exception:   # noqa: BLE001 -- recorded, named by its label
            outcome = traceback.format_exc()[-1500:]
        if axonmpi.is_initialized():
            axonmpi.distributed.destroy()        # the next layout lays its own grid over the ranks
        outcomes = comm.allgather(outcome)
        if comm.rank == 0:
            results[label] = next((o for o in outcomes if o != "ok"), "ok")
            print(f"{label} [{model}] {time.perf_counter() - t0:.1f} s: {results[label][:200]}", flush=True)
            with open(done, "w") as f:
                json.dump(results, f)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
