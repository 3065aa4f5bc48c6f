"""Print the slowest tests of every ``make test`` pass together: ``python tests/slowest.py .test-logs [N]``.

Each pass's rank 0 writes ``.test-logs/durations-np<N>-<pid>.tsv`` (seconds, ranks, test id; setup + call +
teardown), see ``tests/conftest.py``."""
import glob
import os
import sys


def main(logdir: str, top: int = 10) -> None:
    rows = []
    for path in glob.glob(os.path.join(logdir, "durations-np*.tsv")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                t, n, name = line.rstrip("\n").split("\t", 2)
                rows.append((float(t), int(n), name))
    if not rows:
        return
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"=== the {min(top, len(rows))} slowest of {len(rows)} test runs (all passes; {total:.0f} s of tests in all) ===")
    for t, n, name in rows[:top]:
        print(f"{t:8.2f}s  {n} rank(s)  {name}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10)
