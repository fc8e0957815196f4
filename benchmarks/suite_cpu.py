"""Per-file CPU seconds of a test run, from the file tests/conftest.py writes when
MEMKIT_TEST_CPU_REPORT is set (one JSON line per test: self + waited-for children, setup included):

    MEMKIT_TEST_CPU_REPORT=/tmp/cpu.jsonl python -m pytest -q tests
    python benchmarks/suite_cpu.py /tmp/cpu.jsonl [N]     # N: also list the N most expensive tests

CPU seconds do not depend on what else the machine runs; on CI's 2 idle cores the suite's wall
time is about their total over 2."""
from __future__ import annotations

import collections
import json
import sys


def main(argv: list[str]) -> None:
    per_file, count, tests = collections.Counter(), collections.Counter(), []
    with open(argv[0]) as handle:
        for line in handle:
            row = json.loads(line)
            name = row["test"].split("::")[0]
            per_file[name] += row["cpu_s"]
            count[name] += 1
            tests.append((row["cpu_s"], row["test"]))
    print(f"{'CPU s':>9}  {'tests':>5}  file")
    for name, seconds in per_file.most_common():
        print(f"{seconds:9.1f}  {count[name]:5d}  {name}")
    print(f"{sum(per_file.values()):9.1f}  {sum(count.values()):5d}  total")
    for seconds, test in sorted(tests, reverse=True)[:int(argv[1]) if len(argv) > 1 else 0]:
        print(f"{seconds:9.1f}  {test}")


if __name__ == "__main__":
    main(sys.argv[1:])
