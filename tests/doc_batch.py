"""Run several documentation blocks in one job (``tests/test_docs.py``): each rank runs each script in turn, as
``python script`` would (``__main__``, its own folder, ``sys.argv``), and rank 0 writes one JSON line per block:
``{"id": ..., "ok": bool}`` once every rank has finished it. A block ok on every rank passes; any other
outcome (an exception, a hang, a job that ends early) makes test_docs run that block again alone, as before,
and judge it by that run. Starting a job costs seconds per rank on a 2-core machine; most blocks take less.

The ranks agree on each block's outcome over their own copy of COMM_WORLD, so a block that fails on one
rank while another waits in the block's collective cannot be matched with the agreement: the job then hangs
until test_docs' timeout, and every block not yet reported runs alone.

Usage: python doc_batch.py PLAN.json RESULTS.jsonl   (PLAN: [{"id", "script", "cwd"}, ...])
"""
import json
import os
import runpy
import sys
import traceback


def _run(script: str, cwd: str) -> bool:
    env, argv, here, path = dict(os.environ), list(sys.argv), os.getcwd(), list(sys.path)
    os.chdir(cwd)
    sys.argv = [script]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
        return True
    except SystemExit as e:
        return e.code in (None, 0)
    except BaseException:  # noqa: BLE001 - a block's failure is reported, the block run alone decides
        traceback.print_exc()
        return False
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.argv, sys.path[:] = argv, path
        os.chdir(here)


def main(plan_path: str, out_path: str) -> None:
    plan = json.load(open(plan_path, encoding="utf-8"))
    try:
        from mpi4py import MPI
        agree = MPI.COMM_WORLD.Dup()
    except Exception:  # noqa: BLE001 - a plain process (blocks without `# mpiexec -n N`)
        agree = None
    rank = agree.Get_rank() if agree is not None else 0
    out = open(out_path, "a", encoding="utf-8") if rank == 0 else None
    for item in plan:
        ok = _run(item["script"], item["cwd"])
        if agree is not None:
            ok = bool(agree.allreduce(int(ok), op=MPI.MIN))
        if out is not None:
            out.write(json.dumps({"id": item["id"], "ok": ok}) + "\n")
            out.flush()
        _fresh_world()


def _fresh_world() -> None:
    """The next block starts as a new process would: no World (its first ``init`` may ask for another grid)."""
    world = sys.modules.get("axonmpi.distributed.world")
    if world is not None and getattr(world, "_WORLD", None) is not None:
        world.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
