r"""Held-out accuracy of runs on a task with a right answer, at their first and last evaluation: the evaluation's
pass@k (metrics.jsonl: eval/pass@1, eval/pass@<n>, with --eval_success_threshold) and greedy pass@1 (samples.jsonl:
the mean reward of the greedy sample table over the test prompts, which is the accuracy when the reward is 1 for a right
answer and 0 otherwise, as benchmark/experiments/arithmetic_cpu.sh trains), and the completion tokens the run generated
to its last update (every round of --dynamic_sampling: sampling/generated_tokens; else completions/mean_length times
each update's completions), the x of an equal-compute comparison. One row per run, then each group's mean and standard
deviation over its runs, as a markdown table. --summary prints each group's row alone, with what the runs did besides
their accuracy: the KL to the reference at the last update, the clip fraction (clip_ratio/region_mean) over all
updates, and the minutes per run (a run's wall_clock.json, as compare_algorithms.py --results keeps it; else its
training time at its last update):

    python benchmark/accuracy_table.py --runs runs --regex '^(rloo|rloo_vllm)__'
    python benchmark/accuracy_table.py --runs runs --regex '^(arith_plain|arith_dynamic)__' --at_tokens 11000
    python benchmark/accuracy_table.py --runs benchmark/results/compare_arithmetic --regex '^(.+)__\d+$' --summary
"""

import argparse
import glob
import json
import math
import os
import re
import statistics
import sys

import numpy as np
from plot import update_tokens  # (benchmark/, this script's folder)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_evaluations(run: str) -> dict[str, list[tuple[int, float]]]:
    """Each accuracy of a run at each of its evaluations: [(the episode it follows, value)]."""
    evaluations = [row for row in read_jsonl(os.path.join(run, "metrics.jsonl")) if "eval/pass@1" in row]
    found = {}
    for name in sorted({k for k in evaluations[0] if re.fullmatch(r"eval/pass@\d+", k)} if evaluations else []):
        found[name[5:]] = [(row["step"], row[name]) for row in evaluations if name in row]
    samples = os.path.join(run, "samples.jsonl")
    tables = {}
    for row in read_jsonl(samples) if os.path.exists(samples) else []:
        tables.setdefault(row["step"], []).append(row["reward"])
    found["greedy pass@1"] = [(step, sum(rewards) / len(rewards)) for step, rewards in sorted(tables.items())]
    return {name: points for name, points in found.items() if len(points) >= 2}


def run_accuracy(run: str, at_tokens=None) -> dict[str, tuple]:
    """Each accuracy of a run: (at its first evaluation, at its last); with at_tokens, (its value where the run had
    generated that many tokens, between the evaluations around it; None past its last)."""
    evaluations = run_evaluations(run)
    if at_tokens is None:
        return {name: (points[0][1], points[-1][1]) for name, points in evaluations.items()}
    tokens = tokens_by_episode(run)
    found = {}
    for name, points in evaluations.items():
        xs = [max(t for e, t in tokens.items() if e <= episode) for episode, _ in points]  # the updates before it
        ys = [value for _, value in points]
        found[name] = (float(np.interp(at_tokens, xs, ys)) if at_tokens <= xs[-1] else None,)
    return found


def tokens_by_episode(run: str) -> dict[int, float]:
    """The completion tokens the run generated up to each episode its updates end at (0 before the first)."""
    total, episode, tokens = 0.0, 0, {0: 0.0}
    for row in read_jsonl(os.path.join(run, "metrics.jsonl")):
        if "episode" in row:
            total += update_tokens(row, episode)
            episode = row["episode"]
            tokens[episode] = total
    return tokens


def training_numbers(run: str) -> dict[str, float]:
    """What a run did besides its accuracy: "kl" at its last update (nan with --beta 0: not logged), the mean "clip"
    fraction over its updates, and its "minutes" (wall_clock.json's seconds, to its saved model; else the training
    time its last update's eps says)."""
    rows = [row for row in read_jsonl(os.path.join(run, "metrics.jsonl")) if "episode" in row]  # the updates'
    clock = os.path.join(run, "wall_clock.json")
    seconds = json.load(open(clock)).get("seconds") if os.path.isfile(clock) else None
    return {
        "kl": rows[-1].get("kl", float("nan")),
        "clip": statistics.mean(row["clip_ratio/region_mean"] for row in rows),
        "minutes": (seconds or rows[-1]["episode"] / rows[-1]["eps"]) / 60,
    }


def value_text(value) -> str:
    return "not reached" if value is None else f"{value:.3f}"


def mean_and_std(values):
    """'0.739 ± 0.042': the sample standard deviation, 0 for a single run."""
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {spread:.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=["runs"], help="folders holding run folders")
    parser.add_argument("--regex", required=True, help="groups runs by this regular expression on the folder name")
    parser.add_argument(
        "--at_tokens",
        type=lambda text: text if text == "least" else float(text),
        default=None,
        help="each accuracy where the run had generated this many completion tokens (between its evaluations); "
        "least: the fewest any of the runs generated, where every run is compared at equal generation",
    )
    parser.add_argument("--summary", action="store_true", help="each group's row alone, with its KL, clip and minutes")
    args = parser.parse_args(argv)
    try:
        regex = re.compile(args.regex)
    except re.error as e:
        parser.error(f"--regex {args.regex!r} is not a regular expression: {e}")
    runs = [
        os.path.dirname(r)
        for folder in args.runs
        for r in sorted(glob.glob(os.path.join(folder, "*", "metrics.jsonl")))
    ]
    matched = [run for run in runs if regex.search(os.path.basename(run)) and run_evaluations(run)]
    if args.at_tokens == "least" and matched:
        args.at_tokens = min(max(tokens_by_episode(run).values()) for run in matched)
    groups: dict[str, dict[str, dict]] = {}
    for run in matched:
        match = regex.search(os.path.basename(run))
        accuracy = run_accuracy(run, args.at_tokens)
        if accuracy:
            groups.setdefault(match.group(1) if match.groups() else match.group(0), {})[run] = accuracy
    if not groups:
        sys.exit(
            f"accuracy_table.py: error: no run in {' '.join(args.runs)} matches {args.regex!r} with two evaluations"
        )
    names = sorted({name for runs in groups.values() for accuracy in runs.values() for name in accuracy})
    names = ["greedy pass@1", *[n for n in names if n != "greedy pass@1"]] if "greedy pass@1" in names else names
    heading = "first -> last" if args.at_tokens is None else f"at {args.at_tokens:.0f} tokens"
    more = " kl at the end | clip fraction | minutes per run |" if args.summary else ""
    print(f"| group | run | tokens generated | {' | '.join(f'{n}: {heading}' for n in names)} |{more}")
    print(f"|---|---|---|{'---|' * len(names)}" + ("---|" * 3 if args.summary else ""))
    for group, runs in groups.items():
        tokens = {run: max(tokens_by_episode(run).values()) for run in runs}
        for run, accuracy in runs.items() if not args.summary else []:
            cells = [" -> ".join(value_text(v) for v in accuracy[n]) if n in accuracy else "" for n in names]
            print(f"| {group} | {os.path.basename(run)} | {tokens[run]:.0f} | {' | '.join(cells)} |")
        cells = []
        for name in names:
            pairs = [accuracy[name] for accuracy in runs.values() if name in accuracy and None not in accuracy[name]]
            cells.append(" -> ".join(mean_and_std(values) for values in zip(*pairs)))
            if len(pairs) < len(runs):  # --at_tokens past the last evaluation of some
                cells[-1] = f"{cells[-1]} ({len(pairs)} of {len(runs)} reached it)" if pairs else "not reached"
        if args.summary:
            numbers = [training_numbers(run) for run in runs]
            kl = [n["kl"] for n in numbers]
            cells.append("n/a" if any(math.isnan(v) for v in kl) else mean_and_std(kl))
            cells.append(f"{statistics.mean(n['clip'] for n in numbers):.3f}")
            cells.append(f"{statistics.mean(n['minutes'] for n in numbers):.1f}")
        spread = statistics.stdev(tokens.values()) if len(tokens) > 1 else 0.0
        mean_tokens = f"{statistics.mean(tokens.values()):.0f} ± {spread:.0f}"
        print(f"| **{group}** | **mean ± std of {len(runs)}** | {mean_tokens} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
