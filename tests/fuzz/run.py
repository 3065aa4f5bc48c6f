"""Run the composition fuzzer: ``mpiexec -n 4 python tests/fuzz/run.py --cases 100 --seed 0``.

Each seed draws a model and two layouts (:mod:`cases`) and compares them with the serial model
(:mod:`harness`).  A failure prints its seed (``--only SEED`` reruns it) and, with ``--shrink`` (the
default), the smallest model and layout that still fail.  Exit status 1 when any case failed.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("AXONMPI_TIMEOUT", "120")     # a hang ends the job with its report, not the suite

import axonmpi  # noqa: E402

from cases import Case, draw_case, simpler_layouts, simpler_models, valid  # noqa: E402
from harness import outcome  # noqa: E402


def shrink(world, case: Case, detail: str, budget: int = 40):
    """The smallest case (fewer blocks, features and axes) that still fails; ``(case, detail)``."""
    changed, tries = True, 0
    while changed and tries < budget:
        changed = False
        candidates = [Case(case.seed, m, case.layout, case.restore) for m in simpler_models(case.model)]
        candidates += [Case(case.seed, case.model, lay, case.restore) for lay in simpler_layouts(case.layout)]
        candidates += [Case(case.seed, case.model, case.layout, lay) for lay in simpler_layouts(case.restore)]
        for c in candidates:
            if not (valid(c.model, c.layout, world.world_size) and valid(c.model, c.restore, world.world_size)):
                continue
            tries += 1
            st, d = outcome(world, c)
            if st == "failed":
                case, detail, changed = c, d, True
                break
            if tries >= budget:
                break
    return case, detail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=20, help="how many seeds (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    ap.add_argument("--only", type=int, nargs="*", help="run just these seeds")
    ap.add_argument("--no-shrink", action="store_true", help="report failures as drawn")
    ap.add_argument("--no-checkpoint", action="store_true", help="skip the save / restore under a second layout")
    ap.add_argument("--stop", action="store_true", help="stop at the first failure")
    ap.add_argument("--style", choices=("library", "user", "both"), default="both",
                    help="models of the library's layers, written our way; models as PyTorch users write them "
                         "(their own attention, class token, shared gain, own positions: tests/fuzz/user.py); or "
                         "each seed both ways (default)")
    ap.add_argument("--with-0d", action="store_true", help="user-style models may hold a 0-d parameter")
    args = ap.parse_args(argv)
    if args.cases < 1:
        ap.error(f"--cases {args.cases}: must be at least 1")
    world = axonmpi.init()
    seeds = args.only if args.only else range(args.seed, args.seed + args.cases)
    counts, failed, reasons = collections.Counter(), [], collections.Counter()
    t0 = time.time()
    styles = {"library": (False,), "user": (True,), "both": (False, True)}[args.style]
    for seed, user_style in ((s, u) for s in seeds for u in styles):
        case = draw_case(seed, world.world_size, user_style, args.with_0d)
        st, detail = outcome(world, case, checkpoint=not args.no_checkpoint)
        counts[st] += 1
        if world.rank == 0:
            print(f"[{time.time() - t0:7.1f}s] seed {seed}{' user' if user_style else ''}: {st}"
                  + (f" ({detail})" if st == "refused" else ""), flush=True)
        if st == "refused":
            kind, _, msg = detail.partition(": ")
            msg = re.sub(r"^(\(rank \d+\) \w+: )?rank \d+: ", "", msg)
            reasons[kind + ": " + re.sub(r"'[^']*'|\[[^\]]*\]", "..", msg)[:100]] += 1
        if st == "failed":
            small, sdetail = (case, detail) if args.no_shrink else shrink(world, case, detail)
            failed.append(f"{seed}{' user' if user_style else ''}")
            if world.rank == 0:
                print(f"FAILED {case.describe()}\n  {detail}", flush=True)
                if small != case:
                    print(f"  smallest failing case:\n  {small.describe()}\n  {sdetail}", flush=True)
            if args.stop:
                break
    if world.rank == 0:
        print(f"\n{sum(counts.values())} cases at {world.world_size} ranks in {time.time() - t0:.0f} s: "
              f"{counts['ok']} equal serial, {counts['refused']} refused at construction, {counts['failed']} failed"
              + (f" (seeds {failed})" if failed else ""))
        for r, n in reasons.most_common():
            print(f"  refused x{n}: {r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
