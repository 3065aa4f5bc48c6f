"""Print the slowest tests of every ``make test`` pass together: ``python tests/slowest.py .test-logs [N]``.

Each pass's rank 0 writes ``.test-logs/durations-np<N>-<pid>.tsv`` (seconds, ranks, test id; setup + call +
teardown), see ``tests/conftest.py``."""
import glob
import os
import sys


def read(logdir: str, pattern: str = "durations-np*.tsv"):
    """``(seconds, ranks, test id)`` of every line of the pass files matching ``pattern``."""
    for path in glob.glob(os.path.join(logdir, pattern)):
        with open(path, encoding="utf-8") as f:
            for line in f:
                t, n, name = line.rstrip("\n").split("\t", 2)
                yield float(t), int(n), name


def main(logdir: str, top: int = 10) -> None:
    rows = list(read(logdir))
    if not rows:
        return
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"=== the {min(top, len(rows))} slowest of {len(rows)} test runs (all passes; {total:.0f} s of tests in all) ===")
    for t, n, name in rows[:top]:
        print(f"{t:8.2f}s  {n} rank(s)  {name}")


def write_np1(logdir: str, out: str) -> None:
    """The 1-rank pass's time of every test that ran (``--write-np1 tests/durations-np1.tsv``): the weights
    ``--shard`` balances the 1-rank pass's shards by (tests/conftest.py)."""
    rows = {}
    for t, _, name in read(logdir, "durations-np1-*.tsv"):
        rows[name] = max(rows.get(name, 0.0), t)
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(f"{t:.2f}\t1\t{name}\n" for name, t in sorted(rows.items()))
    print(f"wrote {len(rows)} tests' times to {out}")


if __name__ == "__main__":
    if "--write-np1" in sys.argv:
        write_np1(sys.argv[1], sys.argv[sys.argv.index("--write-np1") + 1])
    else:
        main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10)
