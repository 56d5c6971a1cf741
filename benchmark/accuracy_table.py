"""Held-out accuracy of runs on a task with a right answer, at their first and last evaluation: the evaluation's
pass@k (metrics.jsonl: eval/pass@1, eval/pass@<n>, with --eval_success_threshold) and greedy pass@1 (samples.jsonl:
the mean reward of the greedy sample table over the test prompts, which is the accuracy when the reward is 1 for a right
answer and 0 otherwise, as benchmark/experiments/arithmetic_cpu.sh trains), and the completion tokens the run generated
to its last update (every round of --dynamic_sampling: sampling/generated_tokens; else completions/mean_length times
each update's completions), the x of an equal-compute comparison. One row per run, then each group's mean and standard
deviation over its runs, as a markdown table:

    python benchmark/accuracy_table.py --runs runs --regex '^(rloo|rloo_vllm)__'
"""

import argparse
import glob
import json
import os
import re
import statistics
import sys


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_accuracy(run: str) -> dict[str, tuple[float, float]]:
    """Each accuracy of a run: (at its first evaluation, at its last)."""
    evaluations = [row for row in read_jsonl(os.path.join(run, "metrics.jsonl")) if "eval/pass@1" in row]
    found = {}
    if len(evaluations) >= 2:
        for name in sorted({k for k in evaluations[0] if re.fullmatch(r"eval/pass@\d+", k)}, key=lambda k: int(k[10:])):
            found[name[5:]] = (evaluations[0][name], evaluations[-1][name])
    samples = os.path.join(run, "samples.jsonl")
    tables = {}
    for row in read_jsonl(samples) if os.path.exists(samples) else []:
        tables.setdefault(row["step"], []).append(row["reward"])
    if len(tables) >= 2:
        first, last = tables[min(tables)], tables[max(tables)]
        found["greedy pass@1"] = (sum(first) / len(first), sum(last) / len(last))
    return found


def generated_tokens(run: str) -> float:
    """The completion tokens the run generated, over its updates."""
    total, episode = 0.0, 0
    for row in read_jsonl(os.path.join(run, "metrics.jsonl")):
        if "episode" in row:
            total += row.get("sampling/generated_tokens", row["completions/mean_length"] * (row["episode"] - episode))
            episode = row["episode"]
    return total


def mean_and_std(values):
    """'0.739 ± 0.042': the sample standard deviation, 0 for a single run."""
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {spread:.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=["runs"], help="folders holding run folders")
    parser.add_argument("--regex", required=True, help="groups runs by this regular expression on the folder name")
    args = parser.parse_args(argv)
    try:
        regex = re.compile(args.regex)
    except re.error as e:
        parser.error(f"--regex {args.regex!r} is not a regular expression: {e}")
    groups: dict[str, dict[str, dict]] = {}
    for folder in args.runs:
        for run in sorted(glob.glob(os.path.join(folder, "*", "metrics.jsonl"))):
            run = os.path.dirname(run)
            match = regex.search(os.path.basename(run))
            accuracy = run_accuracy(run) if match else {}
            if accuracy:
                groups.setdefault(match.group(1) if match.groups() else match.group(0), {})[run] = accuracy
    if not groups:
        sys.exit(
            f"accuracy_table.py: error: no run in {' '.join(args.runs)} matches {args.regex!r} with two evaluations"
        )
    names = sorted({name for runs in groups.values() for accuracy in runs.values() for name in accuracy})
    names = ["greedy pass@1", *[n for n in names if n != "greedy pass@1"]] if "greedy pass@1" in names else names
    print(f"| group | run | tokens generated | {' | '.join(f'{n}: first -> last' for n in names)} |")
    print(f"|---|---|---|{'---|' * len(names)}")
    for group, runs in groups.items():
        tokens = {run: generated_tokens(run) for run in runs}
        for run, accuracy in runs.items():
            cells = [f"{accuracy[n][0]:.3f} -> {accuracy[n][1]:.3f}" if n in accuracy else "" for n in names]
            print(f"| {group} | {os.path.basename(run)} | {tokens[run]:.0f} | {' | '.join(cells)} |")
        cells = []
        for name in names:
            pairs = [accuracy[name] for accuracy in runs.values() if name in accuracy]
            cells.append(" -> ".join(mean_and_std(values) for values in zip(*pairs)))
        spread = statistics.stdev(tokens.values()) if len(tokens) > 1 else 0.0
        mean_tokens = f"{statistics.mean(tokens.values()):.0f} ± {spread:.0f}"
        print(f"| **{group}** | **mean ± std of {len(runs)}** | {mean_tokens} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
