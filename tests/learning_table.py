"""The learning tests over seeds, as docs/tests.md's table: each test's mean reward of its first and last updates (3 of
each, 10 for the VLM's 80) per seed, and the smallest gain, from the file the tests append to with --learning_record.

    for seed in 1 2 3 4 5; do
        python -m pytest tests -m learning -q -n 2 --dist loadfile --learning_seed $seed --learning_record learning.jsonl
    done
    python tests/learning_table.py learning.jsonl
"""

import argparse
import collections
import json
import os
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("record", help="the JSON lines file the tests wrote (--learning_record)")
    args = parser.parse_args()
    try:
        with open(args.record) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"error: cannot read {args.record} ({e}): run the learning tests with --learning_record first")
    if not rows:
        sys.exit(f"error: {args.record} holds no rewards: run the learning tests with --learning_record {args.record}")
    by_test = collections.defaultdict(dict)
    for row in rows:
        file, name = row["test"].split("::", 1)
        by_test[f"{os.path.basename(file)}::{name}"][row["seed"]] = row  # a seed run again: its last run
    seeds = sorted({seed for runs in by_test.values() for seed in runs})
    print("| test | " + " | ".join(f"seed {s}: first -> last" for s in seeds) + " | smallest gain |")
    print("|---" * (len(seeds) + 2) + "|")
    for test, runs in sorted(by_test.items()):
        cells = [f"{runs[s]['first']:.2f} -> {runs[s]['last']:.2f}" if s in runs else "" for s in seeds]
        gain = min(run["last"] - run["first"] for run in runs.values())
        print(f"| {test} | " + " | ".join(cells) + f" | {gain:.2f} |")


if __name__ == "__main__":
    main()
