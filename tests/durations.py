"""Where the suite's time goes, from the JUnit reports the README's test command writes (.test-durations/*.xml): the
slowest tests and each file's total, as the markdown tables of docs/tests.md. A test's seconds are its setup, call
and teardown: a module's fixture counts to the first test that asks for it.

    python tests/durations.py .test-durations/fast.xml .test-durations/slow.xml [--top 20]
"""

import argparse
import collections
import os
import sys
import xml.etree.ElementTree as ElementTree


def read_reports(paths: list[str]) -> list[tuple[str, str, float]]:
    """(file, test, seconds) of every test case in the reports."""
    cases = []
    for path in paths:
        try:
            root = ElementTree.parse(path).getroot()
        except (OSError, ElementTree.ParseError) as e:
            sys.exit(f"error: {path} is not a JUnit report pytest wrote ({e}); run the README's test command first")
        for case in root.iter("testcase"):
            module = case.get("classname", "").split(".")
            file = module[1] + ".py" if len(module) > 1 and module[0] == "tests" else ".".join(module) + ".py"
            cases.append((file, case.get("name", ""), float(case.get("time", 0))))
    return cases


def tables(cases: list[tuple[str, str, float]], top: int) -> str:
    lines = [f"| the {top} slowest tests | seconds |", "|---|---|"]
    for file, name, seconds in sorted(cases, key=lambda c: -c[2])[:top]:
        lines.append(f"| {file}::{name} | {seconds:.1f} |")
    per_file = collections.defaultdict(lambda: [0, 0.0])
    for file, _, seconds in cases:
        per_file[file][0] += 1
        per_file[file][1] += seconds
    lines += ["", "| file | tests | seconds |", "|---|---|---|"]
    for file, (count, seconds) in sorted(per_file.items(), key=lambda item: -item[1][1]):
        lines.append(f"| {file} | {count} | {seconds:.0f} |")
    total = sum(seconds for _, _, seconds in cases)
    lines.append(f"| all ({len(per_file)} files) | {len(cases)} | {total:.0f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="JUnit XML files (pytest --junitxml)")
    parser.add_argument("--top", type=int, default=20, help="how many of the slowest tests to list")
    args = parser.parse_args()
    missing = [path for path in args.reports if not os.path.isfile(path)]
    if missing:
        sys.exit(f"error: no report at {', '.join(missing)}: run the README's test command first")
    print(tables(read_reports(args.reports), args.top))


if __name__ == "__main__":
    main()
