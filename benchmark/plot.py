"""Learning curves of local runs: mean and spread over seeds, from each run's metrics.jsonl, drawn to a PNG.

    python benchmark/plot.py --runs runs --metrics reward kl completions/mean_length --output curves.png
    python benchmark/plot.py --runs runs --regex '^(rloo|rloo_vllm)__' --x wall --output curves_by_time.png
    python benchmark/plot.py --runs runs --metrics eval/reward eval/pass@1 --output held_out.png

A run is a folder under --runs holding metrics.jsonl (and args.json, the options it ran with). Runs are grouped by an
option of args.json (--group, exp_name by default: rloo, rloo_vllm...; a run without it is a group of its own) or by a regular expression on the run folder's
name (--regex: its first group, or the whole match; runs it does not match are left out). Each group is one line
per metric: the mean over its runs at each x, shaded between mean - std and mean + std (the sample std over runs;
none for a single run). x is the episode (completions so far), the training time in minutes (--x wall: episode / eps,
the seconds the run has trained, a resumed run's earlier part included), or the completion tokens generated so far
(--x generated: the honest x of --dynamic_sampling, which generates more per update). The held-out evaluation's metrics (eval/...)
are rows of their own, at the episode of the update they follow (--x wall: the training time at that update). Runs of
a group whose x values differ (wall time) are interpolated onto the x values of the group's shortest run. The table printed after it gives each group's
mean of the first and last --last points of each metric.
"""

import argparse
import json
import math
import os
import re
import sys

import numpy as np


def load_run(path: str) -> dict:
    """One run folder: {"name", "args", "rows"} (rows empty when it logged nothing yet)."""
    name, metrics = os.path.basename(path), os.path.join(path, "metrics.jsonl")
    leave_out = "leave that run out with --regex, or move it away"
    try:
        with open(metrics) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{metrics} is not JSON lines ({e}): {leave_out}") from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("episode", row.get("step")), (int, float)):
            raise ValueError(f"{metrics} line {i + 1} is not a row of metrics with an episode: {leave_out}")
    args_file = os.path.join(path, "args.json")
    try:
        args = json.load(open(args_file)) if os.path.isfile(args_file) else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{args_file} is not JSON ({e}): {leave_out}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{args_file} holds a {type(args).__name__}, not the run's options: {leave_out}")
    if "__" in name:  # the default run name, <exp_name>__<seed>__<unix time>: the exp_name of older runs
        args.setdefault("exp_name", name.split("__")[0])
    return {"name": name, "args": args, "rows": rows}


def load_runs(folders: list[str]) -> list[dict]:
    """Every run under the folders with a non-empty metrics.jsonl: {"name", "args", "rows"}, sorted by name."""
    runs = []
    for folder in folders:
        if not os.path.isdir(folder):
            raise ValueError(f"--runs {folder} is not a folder: give the folder that holds the run folders (runs)")
        for name in sorted(os.listdir(folder)):
            if os.path.isfile(os.path.join(folder, name, "metrics.jsonl")):
                run = load_run(os.path.join(folder, name))
                if run["rows"]:
                    runs.append(run)
    if not runs:
        raise ValueError(f"no run with a non-empty metrics.jsonl in {', '.join(folders)}")
    return runs


def group_runs(runs: list[dict], key: str, regex) -> dict[str, list[dict]]:
    """{group name: runs}, in the order groups are first met."""
    groups = {}
    for run in runs:
        if regex is not None:
            match = regex.search(run["name"])
            if match is None:
                continue
            name = match.group(1) if regex.groups else match.group(0)
        else:
            name = str(run["args"].get(key, run["name"]))
        groups.setdefault(name, []).append(run)
    if not groups:
        raise ValueError(f"--regex {regex.pattern!r} matches no run folder name (e.g. {runs[0]['name']})")
    return groups


def update_tokens(row: dict, previous_episode: int) -> float:
    """The completion tokens an update generated: every round of --dynamic_sampling (sampling/generated_tokens), else
    completions/mean_length times its completions."""
    return row.get("sampling/generated_tokens", row["completions/mean_length"] * (row["episode"] - previous_episode))


def series(rows: list[dict], metric: str, x: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of one run's metric, rows without a finite value left out. x: episode, training minutes, or the
    completion tokens generated so far (every round of --dynamic_sampling: sampling/generated_tokens; a run without it,
    completions/mean_length times the update's completions). An update's row holds its episode and eps; an
    evaluation's, its step (the episode it follows), and the minutes trained (tokens generated) so far are those of the
    update before it."""
    points, minutes, generated, episode = [], 0.0, 0.0, 0
    for r in rows:
        if "episode" in r:
            minutes = r["episode"] / r["eps"] / 60 if x == "wall" else minutes
            if x == "generated":
                generated += update_tokens(r, episode)
            episode = r["episode"]
        if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric]):
            at = {"episode": r.get("episode", r.get("step")), "wall": minutes, "generated": generated}[x]
            points.append((at, r[metric]))
    return np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float)


def aggregate(curves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, mean, std) over runs: on the shared x when every run has the same, else on the shortest run's x (within
    every run's range), each run interpolated there."""
    curves = [c for c in curves if len(c[0])]
    if all(len(c[0]) == len(curves[0][0]) and np.array_equal(c[0], curves[0][0]) for c in curves):
        xs, ys = curves[0][0], np.stack([c[1] for c in curves])
    else:
        xs = min(curves, key=lambda c: c[0][-1])[0]
        xs = xs[(xs >= max(c[0][0] for c in curves))]
        ys = np.stack([np.interp(xs, cx, cy) for cx, cy in curves])
    return xs, ys.mean(0), ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(len(xs))


def draw(groups: dict[str, list[dict]], metrics: list[str], x: str, title: str = ""):
    """One panel per metric, one line per group: the matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for name, runs in groups.items():
            curves = [series(run["rows"], metric, x) for run in runs]
            if not any(len(c[0]) for c in curves):
                continue
            xs, mean, std = aggregate(curves)
            (line,) = ax.plot(xs, mean, label=f"{name} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
            ax.fill_between(xs, mean - std, mean + std, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(metric)
        ax.set_xlabel({"episode": "episode", "wall": "training time (minutes)", "generated": "tokens generated"}[x])
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def summary(groups: dict[str, list[dict]], metrics: list[str], last: int) -> str:
    """A markdown table: each group's mean (± std over runs) of the first and last `last` points of each metric."""

    def cell(values):
        return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}" if len(values) > 1 else f"{values[0]:.3f}"

    lines = ["| group | runs | metric | first | last |", "|---|---|---|---|---|"]
    for name, runs in groups.items():
        for metric in metrics:
            ys = [series(run["rows"], metric, "episode")[1] for run in runs]
            ys = [y for y in ys if len(y)]
            if ys:
                lines.append(
                    f"| {name} | {len(ys)} | {metric} | {cell([y[:last].mean() for y in ys])} | "
                    f"{cell([y[-last:].mean() for y in ys])} |"
                )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"plot.py: error: {message}")  # one line, no usage block
    parser.add_argument("--runs", nargs="+", default=["runs"], help="folders holding run folders")
    parser.add_argument("--group", default="exp_name", help="the option of args.json that groups runs")
    parser.add_argument("--regex", default=None, help="group by this regular expression on the run folder name instead")
    parser.add_argument("--metrics", nargs="+", default=["reward", "kl", "completions/mean_length"])
    parser.add_argument("--x", choices=["episode", "wall", "generated"], default="episode")
    parser.add_argument("--last", type=int, default=4, help="points averaged for the first and last values printed")
    parser.add_argument("--title", default="")
    parser.add_argument("--output", required=True, help="the PNG to write")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    cli = parser.parse_args(argv)
    if cli.last < 1:
        parser.error(f"--last must be at least 1, got {cli.last}")
    if not cli.output.lower().endswith(".png"):
        parser.error(f"--output {cli.output} is not a .png file name")
    if os.path.exists(cli.output) and not cli.overwrite:
        parser.error(f"{cli.output} exists: pass --overwrite to replace it, or give another --output")
    folder = os.path.dirname(os.path.abspath(cli.output))
    try:  # before the runs are read: an --output that cannot be written is told at once
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        parser.error(f"cannot make the folder of --output {cli.output} ({e.strerror}): give another --output")
    if not os.access(folder, os.W_OK):
        parser.error(f"cannot write in {folder}, the folder of --output {cli.output}: give another --output")
    try:
        regex = re.compile(cli.regex) if cli.regex is not None else None
    except re.error as e:
        parser.error(f"--regex {cli.regex!r} is not a regular expression: {e}")
    try:
        groups = group_runs(load_runs(cli.runs), cli.group, regex)
        found = {k for runs in groups.values() for run in runs for row in run["rows"] for k in row}
        if missing := [m for m in cli.metrics if m not in found]:
            raise ValueError(f"no run logged {', '.join(missing)}; the runs log e.g. {', '.join(sorted(found)[:12])}")
        if cli.x == "wall" and (
            bad := next(
                (
                    run["name"]
                    for runs in groups.values()
                    for run in runs
                    if not all(
                        isinstance(r.get("eps"), (int, float)) and r["eps"] > 0 for r in run["rows"] if "episode" in r
                    )
                ),
                None,
            )
        ):
            raise ValueError(
                f"run {bad} has a row without a positive eps (episodes per second), which --x wall needs: "
                "use --x episode, or leave that run out with --regex"
            )
        if cli.x == "generated" and (
            bad := next(
                (
                    run["name"]
                    for runs in groups.values()
                    for run in runs
                    for r in run["rows"]
                    if "episode" in r and "sampling/generated_tokens" not in r and "completions/mean_length" not in r
                ),
                None,
            )
        ):
            raise ValueError(
                f"run {bad} has an update without sampling/generated_tokens or completions/mean_length, which --x "
                "generated counts: use --x episode, or leave that run out with --regex"
            )
    except ValueError as e:
        parser.error(str(e))
    fig = draw(groups, cli.metrics, cli.x, cli.title)
    try:
        fig.savefig(cli.output, dpi=120)
    except OSError as e:
        parser.error(f"cannot write --output {cli.output} ({e.strerror}): give another --output")
    print(summary(groups, cli.metrics, cli.last))
    print(f"wrote {cli.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
