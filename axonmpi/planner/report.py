"""Tables of the planner's estimates and of its check against the published runs."""
from __future__ import annotations

from typing import Dict, List

from .estimate import PlanEstimate

__all__ = ["format_table", "format_validation"]


def format_table(ests: List[PlanEstimate], top: int = 20) -> str:
    """Rank, the layout (as ``--layout`` takes it), micro-batches, predicted step, memory, TFLOP/s and the
    breakdown's main terms."""
    cols = ("compute_s", "recompute_s", "tp_comm_s", "pp_p2p_s", "bubble_s", "dp_exposed_s", "cp_comm_s", "ep_comm_s")
    width = max([44] + [len(e.layout.label()) for e in ests[:top]])
    head = (f"{'#':>3} {'layout (--layout takes it as printed)':<{width}} {'m':>4} {'step s':>9} {'mem GiB':>8} "
            f"{'TF/s':>8} " + " ".join(f"{c[:-2]:>9}" for c in cols))
    lines = [head]
    for k, e in enumerate(ests[:top], 1):
        lines.append(f"{k:>3} {e.layout.label():<{width}} {e.microbatches:>4} {e.step_time:>9.3f} "
                     f"{e.memory_bytes / 2 ** 30:>8.1f} {e.tflops_per_gpu:>8.3g} "
                     + " ".join(f"{e.breakdown[c]:>9.3f}" for c in cols))
    if not ests:
        lines.append("(no layout fits)")
    return "\n".join(lines)


def format_validation(rows: List[Dict]) -> str:
    """Markdown: row, layout, GPUs, published s, predicted s, error."""
    out = ["| row | layout | GPUs | published s | predicted s | error |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['row']} | {r['layout']} | {r['gpus']} | {r['published_s']:.2f} | {r['predicted_s']:.2f} | "
                   f"{100 * r['error']:+.1f}% |")
    errs = [abs(r["error"]) for r in rows]
    out.append(f"| **mean abs / worst** | | | | | **{100 * sum(errs) / len(errs):.1f}% / {100 * max(errs):.1f}%** |")
    return "\n".join(out)
