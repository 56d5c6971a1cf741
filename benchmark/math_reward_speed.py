"""accuracy_reward's time per 1,000 completions: math-verify in its worker processes (rloo_utils/math_judge.py), with 1
and with the default number of workers, beside math-verify called in this process's main thread as TRL 1.16's
accuracy_reward calls it there (a gold parsed per completion; its signal timeouts on), and as the workers call it (each
distinct gold parsed once): that row against 1 worker's is the cost of the process hop. docs/verifiable.md.

    python benchmark/math_reward_speed.py                      # 1,000 completions, best of 5 repeats
    python benchmark/math_reward_speed.py --completions 200 --repeats 2 --out /tmp/speed.json

The completions are a fixed mix, 8 per problem (a prompt's group): boxed fractions (\\frac, \\dfrac, 0.5 for 1/2),
boxed integers, wrong answers, answers without a box ("The answer is $7$", "The answer is 7"), x = answers, units, and
one in 20 a long reasoning text (~4,000 characters of inline LaTeX) ending in its box; the gold answers are LaTeX
fractions in $...$, decimals and integers (our `answer` column). Every way judges the same completions, and the script
checks that they agree; the workers' start (once per process) is timed apart. Prints a table, writes it as JSON to
--out (benchmark/results/math_reward_speed.json).
"""

import argparse
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rloo_utils.math_judge import WORKERS, MathJudge, judge_answers  # noqa: E402

GROUP = 8  # completions per problem: a gold is shared by its group's completions


def long_reasoning(rng: random.Random, answer: str) -> str:
    """~4,000 characters of step-by-step working with inline LaTeX, then the boxed answer."""
    steps = []
    while sum(map(len, steps)) < 4000:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        steps.append(f"Next, $\\frac{{{a}}}{{{b}}} \\cdot {b} = {a}$, and so $x_{{{len(steps)}}} = {a + b}$. ")
    return "Let's think step by step. " + "".join(steps) + f"Therefore the answer is $\\boxed{{{answer}}}$."


def workload(n: int, seed: int = 1) -> tuple[list, list[str]]:
    """n gold answers (one per completion, GROUP alike in a row) and n completions: the mix of the docstring."""
    rng = random.Random(seed)
    golds, completions = [], []
    while len(completions) < n:
        kind = rng.choice(["fraction", "decimal", "integer"])
        p, q = rng.randint(1, 9), rng.randint(10, 19)
        if kind == "fraction":
            gold, right = f"$\\frac{{{p}}}{{{q}}}$", rng.choice([f"\\frac{{{p}}}{{{q}}}", f"\\dfrac{{{p}}}{{{q}}}"])
        elif kind == "decimal":
            gold, right = f"{p / 8:g}", rng.choice([f"{p / 8:g}", f"\\frac{{{p}}}{{8}}"])
        else:
            gold, right = p * q, str(p * q)  # (an int: the `answer` column of data/arithmetic)
        wrong = f"\\frac{{{q}}}{{{p}}}" if kind == "fraction" else str(p * q + 1)
        for _ in range(GROUP):
            form = rng.random()
            if form < 0.05:
                completion = long_reasoning(rng, right)
            elif form < 0.45:
                completion = f"We simplify and get \\boxed{{{right}}}."
            elif form < 0.65:
                completion = f"So the result is \\boxed{{{wrong}}}."
            elif form < 0.75:
                completion = f"The answer is ${right}$"
            elif form < 0.85:
                completion = f"The answer is {right}"  # plain text: no answer extracted (TRL's config)
            elif form < 0.93:
                completion = f"Solving, \\boxed{{x = {right}}}"
            else:
                completion = f"\\boxed{{{right} \\text{{ cm}}}}"
            golds.append(gold)
            completions.append(completion)
    return golds[:n], completions[:n]


def in_process(golds: list, completions: list[str], once: bool = False) -> list:
    """math-verify in this thread, as TRL's accuracy_reward calls it in the main thread (configs and timeouts): each
    completion's gold parsed again; once: each distinct gold parsed once, as the workers do (their work, no hop)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    config = LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True), boxed_match_priority=0, try_extract_without_anchor=False
    )
    parsed = {}
    rewards = []
    for gold, completion in zip(golds, completions):
        text = gold if isinstance(gold, str) else repr(gold)
        gold = parsed[text] if once and text in parsed else parse(text, parsing_timeout=10)
        parsed[text] = gold
        if not gold:
            rewards.append(None)
            continue
        answer = parse(completion, extraction_config=[config], extraction_mode="first_match", parsing_timeout=10)
        rewards.append(float(verify(gold, answer, timeout_seconds=5)))
    return rewards


def in_workers(golds: list, completions: list[str], judge: MathJudge) -> list:
    """accuracy_reward's judging: the distinct golds, then each completion, in the judge's worker processes."""
    return judge_answers([g if isinstance(g, str) else repr(g) for g in golds], completions, judge)["rewards"]


def best_of(repeats: int, score, *args) -> tuple[float, list]:
    """The fastest of `repeats` calls of score(*args), in seconds, and what the last one returned."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        rewards = score(*args)
        seconds.append(time.perf_counter() - start)
    return min(seconds), rewards


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"math_reward_speed.py: error: {message}")  # one line, no usage block
    parser.add_argument("--completions", type=int, default=1000, help="completions judged per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of each way; the best is kept")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results", "math_reward_speed.json"))
    cli = parser.parse_args()
    if cli.completions < 1 or cli.repeats < 1:
        parser.error(f"--completions and --repeats must be 1 or more, got {cli.completions} and {cli.repeats}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(cli.out))):
        parser.error(f"--out {cli.out}: its folder does not exist")
    golds, completions = workload(cli.completions)
    rows, reference = [], None
    ways = [
        ("math-verify in this process, main thread, a gold parsed per completion (TRL's way)", 0, False),
        ("math-verify in this process, main thread, each gold parsed once (the workers' work)", 0, True),
        ("1 worker process", 1, True),
    ] + [(f"{WORKERS} worker processes (the default)", WORKERS, True)] * (WORKERS > 1)
    for name, workers, once in ways:
        start_seconds = 0.0
        if workers:
            judge = MathJudge(workers=workers)
            start = time.perf_counter()
            judge.judge([{"gold": "$1$"}])  # the workers start: once per process, timed apart
            start_seconds = time.perf_counter() - start
            seconds, rewards = best_of(cli.repeats, in_workers, golds, completions, judge)
            judge.close()
        else:
            in_process(golds[:GROUP], completions[:GROUP])  # imports and regexes, as the workers' warm-up does
            seconds, rewards = best_of(cli.repeats, in_process, golds, completions, once)
        if reference is None:
            reference = rewards
        elif rewards != reference:
            sys.exit(
                f"math_reward_speed.py: error: {name} scored the completions otherwise than in-process math-verify"
            )
        rows.append(
            {
                "way": name,
                "workers": workers,
                "seconds_per_1000": round(seconds * 1000 / cli.completions, 3),
                "start_seconds": round(start_seconds, 2),
            }
        )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    result = {
        "command": " ".join(["python benchmark/math_reward_speed.py", *sys.argv[1:]]),
        "completions": cli.completions,
        "repeats": cli.repeats,
        "cores": cores,
        "share_right": round(sum(r == 1.0 for r in reference) / len(reference), 3),
        "rows": rows,
    }
    print(f"{cli.completions} completions ({result['share_right']:.0%} right), best of {cli.repeats}, {cores} cores")
    print("| way | seconds per 1,000 completions | workers' start (once), s |\n|---|---|---|")
    for row in rows:
        print(f"| {row['way']} | {row['seconds_per_1000']:.2f} | {row['start_seconds'] or '-'} |")
    with open(cli.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"written to {cli.out}")


if __name__ == "__main__":
    main()
