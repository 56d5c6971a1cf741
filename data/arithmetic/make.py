"""Writes this folder's task, one-digit arithmetic with a checkable answer: every "What is a op b?" for a and b in 0-9
and op in +, -, * (300 problems), each a chat prompt with its `answer` and its `data_source` (the operation, so that
the held-out evaluation logs each one's accuracy). A fixed seed picks 20 of each operation for test.jsonl (60), the
other 240 are train.jsonl; the same files on every machine:

    python data/arithmetic/make.py            # writes train.jsonl and test.jsonl next to it (the same files)

SmolLM2-135M-Instruct knows most of these answers but seldom says only the answer: it explains, and runs past the
16 tokens of a completion, or goes on to other numbers after it (docs/verifiable.md)."""

import argparse
import json
import os
import random
import sys

OPERATIONS = {
    "add": ("+", lambda a, b: a + b),
    "subtract": ("-", lambda a, b: a - b),
    "multiply": ("*", lambda a, b: a * b),
}
INSTRUCTION = "Answer with the number only."


def problems() -> list[dict]:
    """Every problem, in a fixed order: its prompt (one user message), its answer (an int), its operation."""
    rows = []
    for source, (symbol, apply) in OPERATIONS.items():
        for a in range(10):
            for b in range(10):
                question = f"What is {a} {symbol} {b}? {INSTRUCTION}"
                rows.append(
                    {"prompt": [{"role": "user", "content": question}], "answer": apply(a, b), "data_source": source}
                )
    return rows


def split(rows: list[dict], test_per_source: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, test): test_per_source problems of each operation drawn with the seed for the test split, the rest
    for training, both shuffled with it."""
    rng = random.Random(seed)
    train, test = [], []
    for source in OPERATIONS:
        own = [r for r in rows if r["data_source"] == source]
        rng.shuffle(own)
        test += own[:test_per_source]
        train += own[test_per_source:]
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)), help="the folder to write to")
    parser.add_argument("--test_per_source", type=int, default=20, help="held-out problems of each operation")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the split")
    args = parser.parse_args()
    if not 1 <= args.test_per_source <= 99:
        parser.error(
            f"--test_per_source {args.test_per_source}: each operation has 100 problems; keep 1 to 99 for test"
        )
    train, test = split(problems(), args.test_per_source, args.seed)
    files = {
        os.path.join(args.out, f"{name}.jsonl"): "".join(json.dumps(row) + "\n" for row in rows)
        for name, rows in [("train", train), ("test", test)]
    }
    for path, text in files.items():  # a file of other content is someone's data: never overwritten
        if os.path.exists(path) and open(path).read() != text:
            sys.exit(
                f"make.py: error: {path} exists and holds other problems: give another --out (nothing is overwritten)"
            )
    try:
        os.makedirs(args.out, exist_ok=True)
        for path, text in files.items():
            with open(path, "w") as f:
                f.write(text)
    except OSError as e:
        sys.exit(f"make.py: error: cannot write to {args.out} ({e.strerror}): give a folder you can write")
    print(f"{len(train)} train and {len(test)} test problems written to {args.out}")
