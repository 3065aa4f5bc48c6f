"""Loss and tokens/s curves of one or several ``--metrics-json`` runs in one PNG (``python -m axonmpi.plot``)."""
from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Optional, Sequence

__all__ = ["load_metrics", "main", "plot_metrics"]


def load_metrics(path: str) -> List[Dict[str, float]]:
    """The rows of a JSON Lines metrics file (``step``, ``loss``, ``grad_norm``, ``lr``, ``tokens_per_s`` ...), or of a
    run folder's ``metrics.jsonl``.

    Example:
        >>> rows = load_metrics("metrics.json")          # doctest: +SKIP
    """
    rows = []
    if os.path.isdir(path):           # a run folder: the metrics.jsonl examples/train_gpt.py writes there
        path = os.path.join(path, "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e.msg}); expected the output of --metrics-json") \
                    from None
            for key in ("step", "loss"):
                if key not in row:
                    raise ValueError(f"{path}:{n}: no {key!r} key; expected the output of --metrics-json")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows; expected the output of --metrics-json")
    return rows


def plot_metrics(paths: Sequence[str], output: str = "metrics.png", labels: Optional[Sequence[str]] = None) -> str:
    """Draw loss (left) and tokens/s (right) against the step, one line per file; return ``output``.

    Needs matplotlib (``pip install 'axonmpi[plot]'``); without it a RuntimeError says how to install it.

    Example:
        >>> plot_metrics(["dp4.json", "tp2pp2.json"], "compare.png")   # doctest: +SKIP
    """
    runs = [load_metrics(p) for p in paths]          # a bad file is named first, matplotlib or not
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(f"axonmpi plot draws with matplotlib, which is not installed ({e}); install it with "
                           "pip install 'axonmpi[plot]' (or pip install matplotlib)") from None
    labels = list(labels) if labels is not None else [os.path.basename(p) for p in paths]
    fig, (ax_loss, ax_tok) = plt.subplots(1, 2, figsize=(11, 4))
    for rows, label in zip(runs, labels):
        steps = [r["step"] for r in rows]
        ax_loss.plot(steps, [r["loss"] for r in rows], label=label)
        key = "tokens_per_s_avg" if all("tokens_per_s_avg" in r for r in rows) else "tokens_per_s"
        if all(key in r for r in rows):
            ax_tok.plot(steps, [r[key] for r in rows], label=label)
    ax_loss.set_xlabel("step"), ax_loss.set_ylabel("loss (mean over the global batch)")
    ax_tok.set_xlabel("step"), ax_tok.set_ylabel("tokens/s")
    ax_loss.legend(), ax_tok.legend()
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m axonmpi.plot run1.json [run2.json ...] [-o out.png]``."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m axonmpi.plot", description=__doc__)
    p.add_argument("files", nargs="+", help="JSON Lines files written by --metrics-json")
    p.add_argument("-o", "--output", default="metrics.png", help="the PNG to write")
    args = p.parse_args(argv)
    try:
        print(plot_metrics(args.files, args.output))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
