"""benchmark/: the launcher (seeds, worker pool, W&B tags, Slurm jobs) and the offline learning curves."""

import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from conftest import ROOT, check_one_line_error, free_port, run_env, wait_for_updates, write_jsonl

sys.path.insert(0, os.path.join(ROOT, "benchmark"))
import compare_algorithms  # noqa: E402
import judge  # noqa: E402
import plot  # noqa: E402
from rloo_utils.vllm_options import check_vllm_args  # noqa: E402
from rloo_utils.models import disable_dropout
from rloo_utils.generation import tokenize_prompts
from rloo_utils import checks, options

LAUNCH = os.path.join(ROOT, "benchmark", "launch.py")
PLOT = os.path.join(ROOT, "benchmark", "plot.py")
JUDGE = os.path.join(ROOT, "benchmark", "judge.py")
TEMPLATE = os.path.join(ROOT, "benchmark", "slurm_template.sh")
LORA_OPTIONS = "--use_peft --lora_target_modules all-linear --learning_rate 3e-4"  # benchmark/lora.py's default


def run_script(script, *args, cwd, env=None):
    return subprocess.run(
        [sys.executable, script, *map(str, args)],
        cwd=cwd,
        env={**run_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def git_describe() -> str:
    tag = subprocess.run(
        ["git", "describe", "--tags", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True, timeout=60
    ).stdout.strip()
    assert tag
    return tag


def tiny_command(tiny, prompts_file) -> str:
    return shlex.join(
        [
            sys.executable,
            os.path.join(ROOT, "rloo.py"),
            "--model_name_or_path",
            tiny["policy"],
            "--dataset_name",
            prompts_file,
            "--total_episodes",
            "64",
            "--per_device_train_batch_size",
            "8",
            "--max_completion_length",
            "8",
            "--num_sample_generations",
            "0",
            "--learning_rate",
            "3e-3",
        ]
    )


@pytest.fixture(scope="module")
def two_runs(tiny, prompts_file, tmp_path_factory):
    """The launcher's run of rloo.py over 2 seeds, 2 at a time, and of a command that prints its tags and seed."""
    cwd = tmp_path_factory.mktemp("launch")
    show = shlex.join(
        [sys.executable, "-c", "import os, sys; print('tags', os.environ['WANDB_TAGS'], 'argv', sys.argv[1:])"]
    )
    proc = run_script(
        LAUNCH,
        "--command",
        tiny_command(tiny, prompts_file),
        "--command",
        show,
        "--num_seeds",
        2,
        "--start_seed",
        4,
        "--workers",
        2,
        "--pr",
        7,
        "--log_dir",
        "logs",
        cwd=cwd,
        env={"WANDB_TAGS": "mine"},
    )
    return cwd, proc


@pytest.mark.slow
def test_the_launcher_runs_every_command_over_the_seeds_with_the_tags(two_runs):
    cwd, proc = two_runs
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = sorted(os.listdir(cwd / "runs"))
    assert [r.split("__")[:2] for r in runs] == [["rloo", "4"], ["rloo", "5"]]
    assert [json.load(open(cwd / "runs" / r / "args.json"))["seed"] for r in runs] == [4, 5]
    # two at a time: the second run started before the first one finished
    events = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith(("started", "finished"))]
    assert events[:2] == ["started", "started"] and len(events) == 8
    # each run's output in its own log; the tags: what WANDB_TAGS held, the checkout's git describe, pr-N
    logs = sorted(os.listdir(cwd / "logs"))
    assert logs == ["00_rloo_seed4.log", "01_rloo_seed5.log", "02_run_seed4.log", "03_run_seed5.log"]
    tag = git_describe()
    for name, seed in (("02_run_seed4.log", "4"), ("03_run_seed5.log", "5")):
        assert (cwd / "logs" / name).read_text().strip() == f"tags mine,{tag},pr-7 argv ['--seed', '{seed}']"


@pytest.mark.slow
def test_a_failed_run_is_named_with_its_log(tmp_path):
    fail = shlex.join([sys.executable, "-c", "import sys; print('out of luck'); sys.exit(3)"])
    proc = run_script(LAUNCH, "--command", fail, "--num_seeds", 1, "--log_dir", "logs", cwd=tmp_path)
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith("failed (exit code 3):") and "logs/00_run_seed1.log" in line, line
    assert (tmp_path / "logs" / "00_run_seed1.log").read_text() == "out of luck\n"


@pytest.mark.slow
def test_slurm_jobs_are_rendered_one_per_run_and_never_overwritten(tmp_path):
    commands = ["python rloo.py --track", "torchrun --nproc_per_node 8 rloo_multigpu.py --track"]
    args = [a for c in commands for a in ("--command", c)] + [
        "--slurm_template",
        TEMPLATE,
        "--slurm_dir",
        "jobs",
        "--num_seeds",
        2,
        "--pr",
        9,
    ]
    proc = run_script(LAUNCH, *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    jobs = sorted(os.listdir(tmp_path / "jobs"))
    assert jobs == ["00_rloo_seed1.sh", "01_rloo_seed2.sh", "02_rloo_multigpu_seed1.sh", "03_rloo_multigpu_seed2.sh"]
    job = (tmp_path / "jobs" / "03_rloo_multigpu_seed2.sh").read_text()
    assert "#SBATCH --job-name=03_rloo_multigpu_seed2\n" in job and "#SBATCH --gpus-per-node=8\n" in job
    assert "#SBATCH --gpus-per-node=1\n" in (tmp_path / "jobs" / "00_rloo_seed1.sh").read_text()
    assert "\ntorchrun --nproc_per_node 8 rloo_multigpu.py --track --seed 2\n" in job
    assert f"\ncd {tmp_path}\n" in job and f"\nexport WANDB_TAGS={git_describe()},pr-9\n" in job
    assert "{{" not in job
    assert [line.split()[1] for line in proc.stdout.splitlines()[1:]] == [f"jobs/{j}" for j in jobs]  # sbatch <file>
    # the same again into the same folder: refused, the jobs untouched
    before = {j: (tmp_path / "jobs" / j).read_text() for j in jobs}
    check_one_line_error(run_script(LAUNCH, *args, cwd=tmp_path), "jobs/00_rloo_seed1.sh exists", "--slurm_dir")
    assert {j: (tmp_path / "jobs" / j).read_text() for j in jobs} == before
    # --slurm_submit hands each job to sbatch (here a stand-in that records what it was given)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/submitted\n')
    (bin_dir / "sbatch").chmod(0o755)
    proc = run_script(
        LAUNCH,
        *[a for c in commands for a in ("--command", c)],
        "--slurm_template",
        TEMPLATE,
        "--slurm_dir",
        "more",
        "--num_seeds",
        1,
        "--slurm_submit",
        cwd=tmp_path,
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "submitted").read_text().split() == ["more/00_rloo_seed1.sh", "more/01_rloo_multigpu_seed1.sh"]


def test_a_log_is_never_overwritten_and_each_launch_has_its_own_folder(tmp_path, monkeypatch):
    """Two launches in the same second get two folders; a log already in --log_dir stays, the new one goes beside it."""
    import launch
    from types import SimpleNamespace

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "time", SimpleNamespace(time=lambda: 1700000000.0))
    hello = shlex.join([sys.executable, "-c", "print('hello')"])
    for _ in range(2):
        assert launch.main(["--command", hello, "--num_seeds", "1"]) == 0
    assert sorted(os.listdir("runs/launch")) == ["1700000000", "1700000000_2"]
    assert all(open(f"runs/launch/{d}/00_run_seed1.log").read() == "hello\n" for d in os.listdir("runs/launch"))
    os.mkdir("logs")
    (tmp_path / "logs" / "00_run_seed1.log").write_text("mine\n")
    assert launch.main(["--command", hello, "--num_seeds", "1", "--log_dir", "logs"]) == 0
    assert (tmp_path / "logs" / "00_run_seed1.log").read_text() == "mine\n"
    assert (tmp_path / "logs" / "00_run_seed1_2.log").read_text() == "hello\n"


def commands_in_group(group: int) -> list[str]:
    """The command names of the processes in a process group (Linux: /proc/<pid>/stat)."""
    names = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if int(rest[2]) == group:  # state, ppid, pgrp
            names.append(name)
    return names


@pytest.mark.slow
def test_ctrl_c_stops_the_launcher_with_one_line(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, LAUNCH, "--command", "sh -c 'sleep 60' x", "--num_seeds", "2", "--log_dir", "logs"],
        cwd=tmp_path,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    # the run is sleeping (`sleep 60 --seed 1` failed at once, so that under load the queue could go on before the
    # Ctrl-C; and the log is opened before the run's process starts)
    deadline = time.time() + 120
    while not (tmp_path / "logs" / "00_run_seed1.log").exists() or "sleep" not in commands_in_group(proc.pid):
        assert proc.poll() is None, proc.communicate(timeout=60)
        assert time.time() < deadline, "the launcher started no run in 120 s"
    os.killpg(proc.pid, signal.SIGINT)
    proc.stderr = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130
    check_one_line_error(proc, "launch.py: error: interrupted", "logs")
    assert sorted(os.listdir(tmp_path / "logs")) == ["00_run_seed1.log"]  # the queued run never started


@pytest.mark.slow
def test_a_run_that_took_ctrl_c_alone_stops_the_queue(tmp_path):
    # the run's own Ctrl-C ends it before the launcher's signal handler runs: its worker must not start the next
    proc = run_script(
        LAUNCH, "--command", "sh -c 'kill -INT $$' x", "--num_seeds", "2", "--log_dir", "logs", cwd=tmp_path
    )
    assert proc.returncode == 130
    check_one_line_error(proc, "launch.py: error: interrupted", "logs")
    assert sorted(os.listdir(tmp_path / "logs")) == ["00_run_seed1.log"]


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--command", "python rloo.py --seed 3"], ["names a --seed", "the launcher adds --seed"]),
        (["--command", "python rloo.py 'x"], ["No closing quotation"]),
        (["--command", " "], ["--command is empty"]),
        (["--command", "x", "--workers", "0"], ["--workers must be at least 1"]),
        (["--command", "x", "--start_seed", "-5"], ["--start_seed must be 0 or more, got -5"]),
        (["--command", "x", "--slurm_submit"], ["go with --slurm_template"]),
        (["--command", "x", "--slurm_template", "nope.sh"], ["cannot read the Slurm template nope.sh"]),
        (["--command", "x", "--slurm_template", "bad.sh"], ["{{partition}}", "does not fill"]),
        (["--command", "x", "--slurm_template", "empty.sh"], ["has no {{command}}"]),
        (["--command", "x", "--log_dir", "bad.sh"], ["cannot write bad.sh", "another --log_dir"]),
        (["--command", "x", "--slurm_template", "bad.sh", "--slurm_dir", "empty.sh"], ["{{partition}}"]),
        (["--command", "x", "--slurm_template", TEMPLATE, "--slurm_dir", "empty.sh"], ["cannot write empty.sh"]),
    ],
)
@pytest.mark.slow
def test_the_launcher_refuses_bad_input_in_one_line(args, needles, tmp_path):
    (tmp_path / "bad.sh").write_text("#SBATCH --partition={{partition}}\n{{command}}\n")
    (tmp_path / "empty.sh").write_text("#!/bin/bash\n")
    proc = run_script(LAUNCH, *args, cwd=tmp_path)
    check_one_line_error(proc, *needles)
    assert sorted(os.listdir(tmp_path)) == ["bad.sh", "empty.sh"]  # nothing run, nothing written


@pytest.mark.slow
def test_the_plot_draws_the_mean_and_spread_of_the_runs_metrics(two_runs, tmp_path):
    cwd, _ = two_runs
    rows = [
        [json.loads(line) for line in open(cwd / "runs" / r / "metrics.jsonl")]
        for r in sorted(os.listdir(cwd / "runs"))
    ]
    proc = run_script(
        PLOT,
        "--runs",
        cwd / "runs",
        "--metrics",
        "reward",
        "completions/mean_length",
        "--output",
        tmp_path / "curves.png",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| rloo | 2 | reward |" in proc.stdout
    # what was drawn: per metric one line, the mean over the two seeds at every episode, shaded by their std
    fig = plot.draw(plot.group_runs(plot.load_runs([str(cwd / "runs")]), "exp_name", None), ["reward", "kl"], "episode")
    for ax, metric in zip(fig.axes, ["reward", "kl"]):
        (line,) = ax.lines
        per_seed = np.array([[r[metric] for r in run] for run in rows])
        np.testing.assert_array_equal(line.get_xdata(), [r["episode"] for r in rows[0]])
        np.testing.assert_allclose(line.get_ydata(), per_seed.mean(0))
        (band,) = ax.collections
        top = band.get_paths()[0].vertices[:, 1].max()
        assert top == pytest.approx((per_seed.mean(0) + per_seed.std(0, ddof=1)).max())
        assert line.get_label() == "rloo (2 runs)"
    # by training time (episode / eps): each seed interpolated onto the x of the shorter one
    minutes = [np.array([r["episode"] / r["eps"] / 60 for r in run]) for run in rows]
    xs, mean, _ = plot.aggregate([(m, np.array([r["reward"] for r in run])) for m, run in zip(minutes, rows)])
    shorter = min(range(2), key=lambda i: minutes[i][-1])
    assert np.all(xs <= minutes[shorter][-1]) and len(xs) >= 1
    expected = np.mean([np.interp(xs, m, [r["reward"] for r in run]) for m, run in zip(minutes, rows)], axis=0)
    np.testing.assert_allclose(mean, expected)


def test_the_plot_counts_the_tokens_generated_over_every_round():
    """--x generated: a run of --dynamic_sampling counts every round's tokens (sampling/generated_tokens), another run
    its completions' mean length times the update's completions; an evaluation sits at the tokens of the update before."""
    dynamic = [
        {"episode": 32, "eps": 1.0, "reward": 0.5, "sampling/generated_tokens": 500.0, "completions/mean_length": 10.0},
        {"step": 32, "eval/pass@1": 0.25},
        {"episode": 64, "eps": 1.0, "reward": 0.75, "sampling/generated_tokens": 700.0, "completions/mean_length": 9.0},
    ]
    plain = [
        {"episode": 32, "eps": 1.0, "reward": 0.5, "completions/mean_length": 10.0},
        {"episode": 64, "eps": 1.0, "reward": 0.5, "completions/mean_length": 8.0},
    ]
    xs, ys = plot.series(dynamic, "reward", "generated")
    assert xs.tolist() == [500.0, 1200.0] and ys.tolist() == [0.5, 0.75]
    assert plot.series(dynamic, "eval/pass@1", "generated")[0].tolist() == [500.0]
    assert plot.series(plain, "reward", "generated")[0].tolist() == [320.0, 576.0]


@pytest.mark.slow
def test_the_plot_refuses_bad_input_in_one_line(two_runs, tmp_path):
    cwd, _ = two_runs
    (tmp_path / "taken.png").write_bytes(b"mine")
    for args, needles in [
        (["--runs", "nowhere"], ["--runs nowhere is not a folder"]),
        (["--runs", tmp_path], ["no run with a non-empty metrics.jsonl"]),
        (["--runs", cwd / "runs", "--metrics", "rewards"], ["no run logged rewards", "reward"]),
        (["--runs", cwd / "runs", "--regex", "^ppo"], ["matches no run folder name"]),
        (["--runs", cwd / "runs", "--regex", "("], ["is not a regular expression"]),
    ]:
        check_one_line_error(run_script(PLOT, *args, "--output", "new.png", cwd=tmp_path), *needles)
    check_one_line_error(
        run_script(PLOT, "--runs", cwd / "runs", "--output", "taken.png", cwd=tmp_path),
        "taken.png exists",
        "--overwrite",
    )
    assert (tmp_path / "taken.png").read_bytes() == b"mine" and not (tmp_path / "new.png").exists()
    for output, needles in [
        ("taken.png/new.png", ["cannot make the folder of --output taken.png/new.png"]),
        ("/proc/new.png", ["/proc/new.png", "give another --output"]),
    ]:
        check_one_line_error(run_script(PLOT, "--runs", cwd / "runs", "--output", output, cwd=tmp_path), *needles)
    check_one_line_error(
        run_script(PLOT, "--runs", cwd / "runs", "--last", 0, "--output", "new.png", cwd=tmp_path),
        "--last must be at least 1",
    )
    # damaged run files: each names the file and how to leave the run out
    for name, args_json, rows, x, needles in [
        ("list_args", "[1, 2]", [{"episode": 8, "reward": 1.0, "eps": 2.0}], "episode", ["args.json holds a list"]),
        (
            "no_episode",
            "{}",
            [{"episode": 8, "reward": 1.0, "eps": 2.0}, {"reward": 2.0}],
            "episode",
            ["metrics.jsonl line 2 is not a row of metrics with an episode"],
        ),
        ("zero_eps", "{}", [{"episode": 8, "reward": 1.0, "eps": 0}], "wall", ["run zero_eps", "positive eps"]),
    ]:
        (tmp_path / "damaged" / name / name).mkdir(parents=True)
        (tmp_path / "damaged" / name / name / "args.json").write_text(args_json)
        write_jsonl(str(tmp_path / "damaged" / name / name / "metrics.jsonl"), rows)
        check_one_line_error(
            run_script(
                PLOT,
                "--runs",
                tmp_path / "damaged" / name,
                "--metrics",
                "reward",
                "--x",
                x,
                "--output",
                "new.png",
                cwd=tmp_path,
            ),
            *needles,
        )
    assert not (tmp_path / "new.png").exists()


@pytest.mark.slow
def test_compare_algorithms_runs_on_the_launcher_and_resumes_where_it_stopped(tmp_path):
    out = tmp_path / "compare"
    script = os.path.join(ROOT, "benchmark", "compare_algorithms.py")
    args = [
        script,
        "--preset",
        "tiny",
        "--configs",
        "rloo",
        "token + ppo_clip",
        "--seeds",
        1,
        2,
        "--workers",
        2,
        "--out",
        out,
        "--",
        "--total_episodes",
        64,
    ]
    # what a user keeps in the same folder: an interrupted run of their own (no model), a note
    (out / "runs" / "mine__1__1" / "checkpoints" / "checkpoint-1").mkdir(parents=True)
    (out / "runs" / "mine__1__1" / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "runs" / "notes.txt").write_text("mine\n")
    theirs = {p: p.read_bytes() for p in (out / "runs").rglob("*") if p.is_file()}
    proc = run_script(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ours = ["rloo__1", "rloo__2", "token_ppo_clip__1", "token_ppo_clip__2"]
    assert sorted(os.listdir(out / "runs")) == sorted(ours + ["mine__1__1", "notes.txt"])
    assert [
        (
            json.load(open(out / "runs" / r / "args.json"))["exp_name"],
            json.load(open(out / "runs" / r / "args.json"))["seed"],
        )
        for r in ours
    ] == [("rloo", 1), ("rloo", 2), ("token_ppo_clip", 1), ("token_ppo_clip", 2)]
    assert sorted(os.listdir(out / "logs")) == [f"{r}.log" for r in ours]
    table = [line for line in proc.stdout.splitlines() if line.startswith(("| rloo |", "| token + ppo_clip |"))]
    assert len(table) == 2
    # the tiny preset's data has a test split: the held-out reward of each run's last evaluation, over the seeds
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| configuration |")).split(" | ")
    last = [
        [
            json.loads(line)["eval/reward"]
            for line in open(out / "runs" / f"rloo__{seed}" / "metrics.jsonl")
            if "eval/" in line
        ][-1]
        for seed in (1, 2)
    ]
    cell = table[0].split(" | ")[header.index("eval/reward, last evaluation")]
    assert cell == f"{statistics.mean(last):.3f} ± {statistics.stdev(last):.3f}", (header, table[0])
    # again: the finished runs are not run again; nothing of the user's is touched
    again = run_script(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "started" not in again.stdout and table == [line for line in again.stdout.splitlines() if line in table]
    # Ctrl-C during a run: it writes a checkpoint, and the same command continues it to the end
    longer = [
        script,
        "--preset",
        "tiny",
        "--configs",
        "rloo",
        "--seeds",
        3,
        "--out",
        out,
        "--",
        "--total_episodes",
        320,
    ]
    running = subprocess.Popen(
        [sys.executable, *map(str, longer)],
        cwd=tmp_path,
        env=run_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    wait_for_updates(running, out / "runs" / "rloo__3" / "metrics.jsonl", 2)
    os.killpg(running.pid, signal.SIGINT)
    stopped = running.communicate(timeout=300)
    assert running.returncode == 130 and "the same command continues" in stopped[1], stopped
    assert (
        os.listdir(out / "runs" / "rloo__3" / "checkpoints")
        and not (out / "runs" / "rloo__3" / "model" / "config.json").exists()
    )
    resumed = run_script(*longer, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in (out / "logs" / "rloo__3_2.log").read_text()
    rows = plot.load_run(out / "runs" / "rloo__3")["rows"]
    assert [r["step"] for r in rows if "episode" in r] == list(range(32, 321, 32))  # each update once
    assert [r["step"] for r in rows if "episode" not in r] == [0, 160, 320]  # its evaluations, each once
    # a run stopped before its first checkpoint stays as it is; the configuration runs anew beside it
    (out / "runs" / "rloo__4").mkdir()
    (out / "runs" / "rloo__4" / "metrics.jsonl").write_text('{"step": 1}\n')
    fresh = run_script(*longer[:6], 4, *longer[7:11], 32, cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert (out / "runs" / "rloo__4" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (out / "runs" / "rloo__4__2" / "model" / "config.json").is_file()
    assert theirs == {p: p.read_bytes() for p in theirs}


def test_the_arithmetic_preset_is_the_arithmetic_experiment_in_two_minibatches():
    """compare_algorithms.py --preset arithmetic runs benchmark/experiments/arithmetic_cpu.sh's rloo.py settings (read
    from the script), each option the same but the micro-batch: the update's 32 completions in two minibatches of 16,
    40 updates, the held-out evaluation and the greedy tables of the 60 test problems."""
    import tyro

    import rloo
    from rloo_utils.checks import check_args

    script = open(os.path.join(ROOT, "benchmark", "experiments", "arithmetic_cpu.sh")).read()
    experiment = shlex.split(re.search(r'ARITHMETIC="([^"]*)"', script).group(1).replace("\\\n", " "))
    experiment.remove("--track")
    argv = [*compare_algorithms.COMMON, *compare_algorithms.PRESETS["arithmetic"]]
    options = lambda words: dict(zip(words[::2], words[1::2]))  # noqa: E731
    preset, theirs = options(argv), options(experiment)
    assert preset.pop("--dataset_name") == os.path.join(ROOT, "data", "arithmetic")
    assert theirs.pop("--dataset_name") == "data/arithmetic"
    assert (preset.pop("--per_device_train_batch_size"), theirs.pop("--per_device_train_batch_size")) == ("16", "32")
    assert preset == {**theirs, "--num_mini_batches": "2"}
    args = tyro.cli(rloo.Args, args=argv, use_underscores=True)
    check_args(args)
    per_update = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    assert (per_update, args.total_episodes // per_update, args.num_generations) == (32, 40, 8)
    assert args.num_sample_generations > 0 and args.eval_steps == 10  # the greedy tables, and pass@1 every 10 updates


@pytest.mark.parametrize(
    "files",
    [
        ["model.safetensors", "config.json"],
        [
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "config.json",
        ],
        ["adapter_model.safetensors", "adapter_config.json"],
    ],
    ids=["one weights file", "shards with their index", "lora adapter"],
)
def test_compare_algorithms_takes_every_saved_model_for_a_finished_run(files, tmp_path):
    """What the scripts save (save_pretrained's one file or shards, peft's adapter) and then the tokenizer: a finished
    run, not trained again; without the tokenizer the save did not end (and no checkpoint: a new attempt)."""
    model = tmp_path / "runs" / "rloo__1" / "model"
    model.mkdir(parents=True)
    for name in [*files, "tokenizer_config.json"]:
        (model / name).write_text("{}")
    assert compare_algorithms.run_state(str(tmp_path), "rloo__1") == ("rloo__1", "finished")
    os.remove(model / "tokenizer_config.json")
    assert compare_algorithms.run_state(str(tmp_path), "rloo__1") == ("rloo__1__2", "new")


def test_pinned_runs_each_hold_one_core_and_one_thread_to_their_last_child(tmp_path, monkeypatch):
    """--cores: each worker's run, and what it starts, runs on the worker's core alone, one thread; two at once hold
    different cores; a core named twice, one too few, or one this process may not run on is refused before a run."""
    import launch

    monkeypatch.chdir(tmp_path)
    cores = sorted(os.sched_getaffinity(0))[:2]
    # the shell starts a Python that reports where it may run: a grandchild of the launcher
    probe = "import os, time; time.sleep(1); print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"
    command = f"{shlex.quote(sys.executable)} -c {shlex.quote(probe)}"
    argv = ["--command", command, "--num_seeds", "2", "--log_dir", "logs", "--workers", str(len(cores)), "--cores"]
    assert launch.main([*argv, *map(str, cores)]) == 0
    said = sorted((tmp_path / "logs" / log).read_text() for log in os.listdir(tmp_path / "logs"))
    if len(cores) == 2:  # the two overlap (each sleeps a second), each on its own core
        assert said == [f"[{cores[0]}] 1\n", f"[{cores[1]}] 1\n"], said
    else:
        assert said == [f"[{cores[0]}] 1\n"] * 2, said
    for wrong, needle in [
        (["--workers", "2", "--cores", "0", "0"], "give 2 different cores, one per worker"),
        (["--workers", "2", "--cores", "0"], "give 2 different cores, one per worker"),
        (["--cores", "100000"], "core 100000 is not one this process may run on"),
    ]:
        with pytest.raises(SystemExit) as refused:
            launch.main(["--command", "touch started", "--log_dir", "refused", *wrong])
        assert needle in str(refused.value) and str(refused.value).startswith("launch.py: error: ")
    assert not os.path.exists("started") and not os.path.exists("refused")


def test_each_run_s_logs_are_kept_as_it_ends_not_when_the_comparison_does(tmp_path):
    """launch.run_all calls `ended` from each run's worker as the run ends, with its exit code; compare_algorithms.py's
    keep_ended keeps a finished run's logs then (with how it ran), and nothing of a run that has not finished."""
    import launch

    ended = []
    commands = [{"name": name, "command": f"exit {code}"} for name, code in [("a", 0), ("b", 3)]]
    codes = launch.run_all(commands, 1, str(tmp_path / "logs"), "", None, lambda run, code: ended.append((run, code)))
    assert codes == [0, 3] and [(run["name"], code) for run, code in ended] == [("a", 0), ("b", 3)]
    out, results = tmp_path / "compare", tmp_path / "kept"
    for name, saved in [("rloo__1", True), ("rloo__2", False)]:
        (out / "runs" / name / "model").mkdir(parents=True)
        (out / "runs" / name / "metrics.jsonl").write_text('{"step": 32, "episode": 32}\n')
        for file in ["model.safetensors", "config.json", "tokenizer_config.json"] if saved else []:
            (out / "runs" / name / "model" / file).write_text("{}")
        compare_algorithms.keep_ended(str(out), str(results), {"workers": 2, "pinned": True}, {"name": name}, 0)
    assert os.listdir(results) == ["rloo__1"]
    assert json.load(open(results / "rloo__1" / "wall_clock.json")) == {"seconds": None, "workers": 2, "pinned": True}


def test_compare_algorithms_keeps_finished_runs_logs_and_rebuilds_its_table_from_them(tmp_path, monkeypatch, capsys):
    """--results: a finished run's logs (not its model) are copied there with the seconds its output said; with them, a
    comparison in a fresh --out runs nothing and prints the same table, its minutes those seconds."""
    out, results = tmp_path / "compare", tmp_path / "kept"
    run = out / "runs" / "rloo__1"
    (run / "model").mkdir(parents=True)
    for name in ["model.safetensors", "config.json", "tokenizer_config.json"]:
        (run / "model" / name).write_text("{}")
    rows = [
        {"episode": 32 * u, "reward": r, "clip_ratio/region_mean": 0.25, "eps": 0.5, "kl": 0.125}
        for u, r in [(1, 0.0), (2, 0.5), (3, 1.0)]
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "samples.jsonl").write_text('{"prompt": "1+1", "completion": "2"}\n')
    (run / "args.json").write_text('{"exp_name": "rloo", "seed": 1}')
    (out / "logs").mkdir()
    (out / "logs" / "rloo__1.log").write_text("stopped\n")
    (out / "logs" / "rloo__1_2.log").write_text(
        "resumed from ...\nsaved the trained model to runs/rloo__1/model (150 s)\n"
    )
    monkeypatch.chdir(tmp_path)
    args = [
        "compare_algorithms.py",
        "--preset",
        "smollm2",
        "--configs",
        "rloo",
        "--seeds",
        "1",
        "--results",
        str(results),
    ]
    monkeypatch.setattr(sys, "argv", [*args, "--out", str(out)])
    compare_algorithms.main()
    first = capsys.readouterr()
    assert "started" not in first.out, first.out + first.err
    assert sorted(os.listdir(results / "rloo__1")) == ["args.json", "metrics.jsonl", "samples.jsonl", "wall_clock.json"]
    assert all((results / "rloo__1" / n).read_text() == (run / n).read_text() for n in ["metrics.jsonl", "args.json"])
    assert json.load(open(results / "rloo__1" / "wall_clock.json")) == {"seconds": 150}  # an earlier comparison ran it
    # reward of the first 3 updates 0.5, of the last 3 the same; KL 0.125; clip 0.25; 150 s
    expected = "| rloo | `(defaults)` | 0.500 | 0.500 | 0.125 | 0.250 | 2.5 |"
    assert expected in first.out.splitlines(), first.out
    monkeypatch.setattr(sys, "argv", [*args, "--out", str(tmp_path / "fresh")])
    compare_algorithms.main()
    again = capsys.readouterr()
    assert "started" not in again.out and expected in again.out.splitlines(), again.out + again.err
    assert os.listdir(tmp_path / "fresh" / "runs") == []


@pytest.mark.slow
def test_compare_algorithms_does_not_train_a_finished_lora_run_again(tmp_path):
    """A --use_peft comparison run again: its run (an adapter in <run>/model) is finished, not trained anew."""
    out = tmp_path / "compare"
    args = [
        os.path.join(ROOT, "benchmark", "compare_algorithms.py"),
        "--preset",
        "tiny",
        "--configs",
        "rloo",
        "--seeds",
        1,
        "--out",
        out,
        "--",
        "--total_episodes",
        64,
        "--use_peft",
    ]
    proc = run_script(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert os.listdir(out / "runs") == ["rloo__1"]
    assert (out / "runs" / "rloo__1" / "model" / "adapter_model.safetensors").is_file()
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| rloo |"))
    again = run_script(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "started" not in again.stdout and row in again.stdout.splitlines()
    assert os.listdir(out / "runs") == ["rloo__1"]


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--out", "a_file"], ["cannot make", "a_file", "another --out"]),
        (["--results", "a_file"], ["--results a_file is a file", "another --results"]),
        (["--workers", "0"], ["--workers and --last must be at least 1"]),
        (["--last", "0"], ["--workers and --last must be at least 1"]),
        (["--seeds", "1", "1"], ["names a seed twice"]),
        (["--seeds", "-1"], ["--seeds must be 0 or more, got -1"]),
        (["--", "--seed", "3"], ["--seed after -- is the comparison's"]),
    ],
)
@pytest.mark.slow
def test_compare_algorithms_refuses_bad_input_in_one_line(args, needles, tmp_path):
    (tmp_path / "a_file").write_text("mine\n")
    check_one_line_error(
        run_script(os.path.join(ROOT, "benchmark", "compare_algorithms.py"), *args, cwd=tmp_path), *needles
    )
    assert sorted(os.listdir(tmp_path)) == ["a_file"] and (tmp_path / "a_file").read_text() == "mine\n"


@pytest.mark.parametrize(
    "script",
    [
        "compare_algorithms.py",
        "logprob_memory.py",
        "output_layer_grad.py",
        "multigpu_memory.py",
        "multigpu_timing.py",
        "resume_check.py",
        "lora.py",
        "padding_free.py",
        "step_timing.py",
        "startup.py",
        "token_budget.py",
        "trl_baseline.py",
        "trl_side_by_side.py",
        "trl_arithmetic.py",
        "vllm_sampling_seeds.py",
        "vllm_timing.py",
        "async_timing.py",
        "off_policy_masks.py",
        "sandbox_speed.py",
        "launch.py",
        "plot.py",
        "judge.py",
        "math_reward_speed.py",
    ],
)
@pytest.mark.slow
def test_every_benchmark_script_says_a_parse_error_in_one_line(script, tmp_path):
    """Not argparse's usage block; trl_baseline.py in TRL's environment (it names that environment in ours)."""
    python = os.path.join(ROOT, ".venv-trl", "bin", "python") if script == "trl_baseline.py" else sys.executable
    proc = subprocess.run(
        [python, os.path.join(ROOT, "benchmark", script), "--bogus"],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    check_one_line_error(proc, f"{script}: error:")
    assert len(proc.stderr.strip().splitlines()) == 1 and "usage:" not in proc.stderr, proc.stderr
    assert "--bogus" in proc.stderr or "the following arguments are required" in proc.stderr
    if script == "trl_baseline.py":
        check_one_line_error(
            run_script(os.path.join(ROOT, "benchmark", script), "--bogus", cwd=tmp_path),
            "TRL is not installed in this Python",
            ".venv-trl/bin/python",
        )


@pytest.mark.slow
def test_the_memory_benchmark_reads_each_process_s_own_peak(tmp_path):
    """multigpu_memory.py on a small model: a peak per process of each run, from the process itself (getrusage), at
    least what the process holds at its optimizer step, and a run of 2 processes whose every process holds less than
    the single process (each has half the model)."""
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmark", "multigpu_memory.py"),
            "--hidden_size",
            "512",
            "--num_layers",
            "4",
            "--intermediate_size",
            "2048",
            "--output",
            "out.json",
        ],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "out.json") as f:
        out = json.load(f)
    runs = out["results"]["now"]
    single, (rank0, rank1) = runs["1"]["peaks"][0], runs["2"]["peaks"]
    # The Llama's parameters by hand: SmolLM2's 49,152 words x 512 (tied), and 4 layers of attention (4 x 512 x 512),
    # MLP (3 x 512 x 2048) and 2 norms, then the last norm
    parameters = 49152 * 512 + 4 * (4 * 512 * 512 + 3 * 512 * 2048 + 2 * 512) + 512
    assert out["parameters"] == parameters
    # At the optimizer step a process holds its share of the fp32 policy, its gradients, AdamW's two moments and the
    # fp32 reference: 20 bytes a parameter (800 MiB; the whole job measured 1,594 MiB on 1 process, 2026-11-29), half
    # of it on each of 2 processes
    held_mib = 20 * parameters / 2**20
    assert held_mib <= single and held_mib / 2 <= min(rank0, rank1), runs
    assert rank0 < single and rank1 < single, runs
    assert "| now | 2 |" in proc.stdout
    check_one_line_error(
        run_script(os.path.join(ROOT, "benchmark", "multigpu_memory.py"), "--processes", "2", cwd=tmp_path),
        "--processes must start with 1",
    )


@pytest.mark.slow
def test_the_lora_benchmark_runs_both_and_draws_their_curves(tiny, prompts_file, tmp_path):
    """benchmark/lora.py on the test model: a row per run (peak memory, seconds per update, rewards) and the curves.
    The runs (kept with --keep) are what it says: the LoRA run trained an adapter, the full run the whole model, each
    for 3 updates of 16 completions; every figure of a row but the memory and the wall time is its run's own logs."""
    options = (
        f"--model_name_or_path {tiny['policy']} --dataset_name {prompts_file} --reward_funcs "
        f"{os.path.join(ROOT, 'tests', 'reward_fixtures.py')}:text_length --max_completion_length 8"
    )
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmark", "lora.py"),
            "--updates",
            "3",
            "--options",
            options,
            "--output",
            "curves.png",
            "--keep",
            "kept",
        ],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in proc.stdout.splitlines()
        if line.startswith(("| lora |", "| full |"))
    }
    assert rows.keys() == {"lora", "full"} and all(
        float(cells[0]) > 100 and float(cells[1]) > 0 for cells in rows.values()
    )
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert f"{options}, 3 updates of 16 completions, seed 1; LoRA: {LORA_OPTIONS}" in proc.stdout
    for name, cells in rows.items():
        run = tmp_path / "kept" / "runs" / f"{name}__1"
        logged = [r for r in plot.load_run(str(run))["rows"] if "episode" in r]
        assert [r["episode"] for r in logged] == [16, 32, 48]  # --updates 3 of 16 completions
        timed = ["time/update", "time/policy_forward_backward", "time/optimizer"]
        later = {k: statistics.mean(r[k] for r in logged[1:]) for k in timed}  # (the first update warms up)
        first, last = (float(x) for x in cells[3].split("->"))  # the first and last tenth: one update each of 3
        assert (float(cells[1]), float(cells[2])) == pytest.approx(
            (later["time/update"], later["time/policy_forward_backward"] + later["time/optimizer"]), abs=0.0051
        )
        assert (first, last, float(cells[4])) == pytest.approx(
            (logged[0]["reward"], logged[-1]["reward"], logged[-1]["kl"]), abs=0.00051
        )
        adapter = (run / "model" / "adapter_model.safetensors").exists()
        assert adapter == (name == "lora") and (run / "model" / "model.safetensors").exists() == (name == "full")
        assert json.loads((run / "args.json").read_text())["use_peft"] == (name == "lora")
    check_one_line_error(
        run_script(os.path.join(ROOT, "benchmark", "lora.py"), "--updates", "1", cwd=tmp_path), "--updates must be >= 2"
    )


@pytest.mark.parametrize(
    "experiment, scripts",
    [
        ("embedded_cpu.sh", ["rloo.py"] * 3 + ["rloo_vllm.py"] * 3),
        ("arithmetic_cpu.sh", ["rloo.py"] * 3 + ["rloo_vllm.py"] * 3),
        ("arithmetic_dynamic_cpu.sh", ["rloo.py"] * 6),
        ("tldr.sh", ["rloo_vllm.py"] * 3 + ["rloo_multigpu.py"] * 3),
    ],
)
@pytest.mark.slow
def test_the_experiment_scripts_run_commands_their_scripts_accept(experiment, scripts, monkeypatch):
    """Each experiment's commands (--dry_run) over 3 seeds, every option one the script knows and accepts."""
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmark", "experiments", experiment), "--dry_run"],
        capture_output=True,
        text=True,
        env=run_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    commands = [shlex.split(line) for line in proc.stdout.splitlines()[1:7]]
    assert [next(w for w in c if w.endswith(".py")) for c in commands] == scripts
    assert [c[-2:] for c in commands] == [["--seed", str(s)] for s in (1, 2, 3)] * 2
    assert "python -m openrlbenchmark.rlops_multi_metrics" in proc.stdout and "benchmark/plot.py" in proc.stdout
    for command in commands:
        script = next(w for w in command if w.endswith(".py"))
        module = __import__(script[:-3])
        monkeypatch.setattr(sys, "argv", [script, *command[command.index(script) + 1 :]])
        args = options.parse_args(module.Args)
        checks.check_args(args)
        module.check_algorithm(args)
        assert args.seed == int(command[-1])


def dry_run_experiment(name: str, out) -> subprocess.CompletedProcess:
    """benchmark/experiments/<name> --dry_run over 2 seeds, its output folder `out`: it succeeded."""
    script = ["bash", os.path.join(ROOT, "benchmark", "experiments", name)]
    env = {**run_env(), "SEEDS": "2", "OUT": str(out)}
    proc = subprocess.run([*script, "--dry_run"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    proc.script = script
    return proc


def check_tiny_task_and_no_reuse(proc, out) -> None:
    """The experiment built its task in `out`, and refuses to run again into that folder. Asked again with --dry_run
    (which it refuses the same, before anything else) and a timeout: were the refusal gone, this would print commands
    and fail, not start an experiment of its default seeds."""
    assert os.path.exists(out / "tiny" / "policy" / "config.json") and (out / "prompts.jsonl").exists()
    env = {**run_env(), "SEEDS": "2", "OUT": str(out)}
    again = subprocess.run([*proc.script, "--dry_run"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert again.returncode != 0 and "exists" in again.stderr
    assert again.stdout == "" and "launch.py" not in again.stderr  # refused first: nothing launched, not even dry


@pytest.mark.slow
def test_the_sampling_experiment_runs_commands_both_scripts_accept(tmp_path, monkeypatch):
    """benchmark/experiments/vllm_sampling_learning.sh (--dry_run): the same task for rloo.py and rloo_vllm.py, each
    seed once, every option accepted; its output folder is made anew, never reused."""
    out = tmp_path / "out"
    proc = dry_run_experiment("vllm_sampling_learning.sh", out)
    commands = [shlex.split(line) for line in proc.stdout.splitlines() if line.startswith("python ")]
    assert [(c[1], c[-1]) for c in commands] == [
        ("rloo.py", "1"),
        ("rloo.py", "2"),
        ("rloo_vllm.py", "1"),
        ("rloo_vllm.py", "2"),
    ]
    for command in commands:
        module = __import__(command[1][:-3])
        monkeypatch.setattr(sys, "argv", command[1:])
        checks.check_args(options.parse_args(module.Args))
        assert [command[i + 1] for i, w in enumerate(command) if w == "--model_name_or_path"] == [f"{out}/tiny/policy"]
    check_tiny_task_and_no_reuse(proc, out)


@pytest.mark.slow
def test_the_async_experiment_runs_commands_rloo_vllm_accepts(tmp_path, monkeypatch):
    """benchmark/experiments/async_learning.sh (--dry_run, which starts no server): --max_staleness 0 and 1 on the same
    task and server, each seed once, pinned to the second core; its output folder is made anew, never reused."""
    out = tmp_path / "out"
    proc = dry_run_experiment("async_learning.sh", out)
    commands = [shlex.split(line) for line in proc.stdout.splitlines() if line.startswith("taskset ")]
    second_core = str(sorted(os.sched_getaffinity(0))[1])
    assert [c[:3] for c in commands] == [["taskset", "--cpu-list", second_core]] * 4
    commands = [c[3:] for c in commands]
    staleness = [c[c.index("--max_staleness") + 1] for c in commands]
    assert [(c[1], s, c[-1]) for c, s in zip(commands, staleness)] == [
        ("rloo_vllm.py", "0", "1"),
        ("rloo_vllm.py", "0", "2"),
        ("rloo_vllm.py", "1", "1"),
        ("rloo_vllm.py", "1", "2"),
    ]
    rloo_vllm = __import__("rloo_vllm")
    for command in commands:
        monkeypatch.setattr(sys, "argv", command[1:])
        args = options.parse_args(rloo_vllm.Args)
        checks.check_args(args)
        check_vllm_args(args, server=True)
        assert args.vllm_mode == "server" and args.model_name_or_path == f"{out}/tiny/policy"
    check_tiny_task_and_no_reuse(proc, out)


@pytest.fixture(scope="module")
def judge_stand_in():
    """An OpenAI-compatible endpoint with no model behind it: it serves --judge_model "judge" and answers every
    comparison "0" (for the checks before generating, and runs whose verdicts do not matter)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # /models
            self.answer({"object": "list", "data": [{"id": "judge", "object": "model"}]})

        def do_POST(self):  # /chat/completions
            self.rfile.read(int(self.headers["Content-Length"]))
            self.answer({"choices": [{"message": {"role": "assistant", "content": "0"}}]})

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


@pytest.mark.slow
def test_the_judge_without_vllm_says_so_in_one_line_before_loading_the_model(tiny, judge_stand_in, tmp_path):
    """The default generator where vLLM does not import (a stand-in package first on the path that raises, as a
    missing or broken install does): one line naming the fixes, before the model loads or --output is claimed.
    --generator hf needs no vLLM."""
    (tmp_path / "shim" / "vllm").mkdir(parents=True)
    (tmp_path / "shim" / "vllm" / "__init__.py").write_text("raise ImportError('vllm is a stand-in here')\n")
    no_vllm = {"PYTHONPATH": str(tmp_path / "shim")}
    args = [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        judge_data(tmp_path),
        "--judge_base_url",
        judge_stand_in,
        "--judge_model",
        "judge",
        "--max_new_tokens",
        4,
    ]
    proc = run_script(JUDGE, *args, "--output", "wins.jsonl", cwd=tmp_path, env=no_vllm)
    check_one_line_error(
        proc, "--generator vllm (the default) needs vLLM", "a stand-in here", "pip install vllm", "--generator hf"
    )
    assert "generating" not in proc.stdout and not (tmp_path / "wins.jsonl").exists()
    proc = run_script(JUDGE, *args, "--generator", "hf", cwd=tmp_path, env=no_vllm)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Model win rate:" in proc.stdout and "12 judged pairs" in proc.stdout


@pytest.mark.slow
def test_the_judge_says_a_folder_without_a_model_holds_none_and_where_its_model_is(tiny, judge_stand_in, tmp_path):
    """A run folder, an unfinished run (its newest checkpoint's policy/, or sharded checkpoints, or none yet) or any
    other folder without a model: one line saying it holds no trained model and what it is, not a tokenizer's error."""
    import shutil

    runs = tmp_path / "runs"
    shutil.copytree(tiny["policy"], runs / "done" / "model")
    for update in (1, 2, 10):  # newest by number, not by name; a tmp- checkpoint is a save that never ended
        shutil.copytree(tiny["policy"], runs / "stopped" / "checkpoints" / f"checkpoint-{update}" / "policy")
        (runs / "stopped" / "checkpoints" / f"checkpoint-{update}" / "training_state.pt").write_bytes(b"")
    shutil.copytree(tiny["policy"], runs / "stopped" / "checkpoints" / "tmp-checkpoint-11" / "policy")
    (runs / "stopped" / "model").mkdir()
    (runs / "sharded" / "checkpoints" / "checkpoint-4" / "dcp").mkdir(parents=True)
    (runs / "sharded" / "checkpoints" / "checkpoint-4" / "training_state.pt").write_bytes(b"")
    (runs / "starting" / "model").mkdir(parents=True)
    (runs / "starting" / "args.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    data = judge_data(tmp_path)
    for folder, needles in [
        (runs / "done", ["it is a run folder", f"whose model is {runs / 'done' / 'model'}"]),
        (runs / "stopped", ["has not finished", "stopped/checkpoints/checkpoint-10/policy"]),
        (runs / "sharded", ["has not finished", "checkpoint-4 holds sharded weights (dcp/)"]),
        (runs / "starting", ["has not finished and has no checkpoint yet"]),
        (tmp_path / "empty", ["runs/<run_name>/model"]),
    ]:
        line = check_one_line_error(
            run_script(
                JUDGE,
                "--model_name_or_path",
                folder,
                "--dataset_name",
                data,
                "--judge_base_url",
                judge_stand_in,
                "--judge_model",
                "judge",
                "--generator",
                "hf",
                cwd=tmp_path,
            ),
            f"--model_name_or_path {folder} holds no trained model",
            *needles,
        )
        assert "tokenizer" not in line.lower(), line


@pytest.mark.slow
def test_the_judge_refuses_a_lora_adapter_for_its_vllm_generator_before_loading(tiny, judge_stand_in, tmp_path):
    """A --use_peft run's model is an adapter: HF generate loads it on its base, a vLLM engine cannot (a traceback
    after the checks): one line naming the merged model, and ~ expanded as for every path."""
    adapter = tmp_path / "lora_run" / "model"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": tiny["policy"]}))
    proc = run_script(
        JUDGE,
        "--model_name_or_path",
        "~/lora_run/model",
        "--dataset_name",
        judge_data(tmp_path),
        "--judge_base_url",
        judge_stand_in,
        "--judge_model",
        "judge",
        cwd=tmp_path,
        env={"HOME": str(tmp_path)},
    )
    line = check_one_line_error(
        proc, f"--model_name_or_path {adapter} holds a LoRA adapter", "--save_merged_model", "--generator hf"
    )
    assert "generating" not in proc.stdout, line


def judge_data(folder) -> str:
    rows = [
        {"prompt": f"the movie was {w} and", "completion": f" it was {w} ."}
        for w in ["good", "bad", "long", "fine"] * 3
    ]
    write_jsonl(str(folder / "data" / "test.jsonl"), rows)
    return str(folder / "data")


@pytest.mark.slow
def test_the_judge_win_rate_comes_from_the_judges_real_answers(tiny, server, tmp_path):
    """The tiny model judged by itself on a real vLLM server: whatever it answers, the win rate is counted from it."""
    common = [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        judge_data(tmp_path),
        "--max_new_tokens",
        8,
        "--judge_base_url",
        server["url"] + "/v1",
        "--judge_model",
        tiny["policy"],
        "--judge_choice",
    ]
    proc = run_script(JUDGE, *common, "--generator", "hf", "--output", "hf.jsonl", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "hf.jsonl")]
    assert len(rows) == 12 and {r["answer"] for r in rows} <= {"0", "1"}  # the choice constraint held
    assert {r["model_position"] for r in rows} == {0, 1}  # positions randomised
    for r in rows:
        assert r["model_wins"] == (int(r["answer"]) == r["model_position"])
    wins = sum(r["model_wins"] for r in rows)
    low, high = judge.wilson_interval(wins, 12)
    assert (
        f"Model win rate: {100 * wins / 12:.2f}% (95% CI {100 * low:.1f}-{100 * high:.1f}%; {wins} of 12 judged"
        in proc.stdout
    )
    # the answers are the server's: asked again (greedy), it says the same
    r = rows[0]
    first, second = (r["model"], r["reference"]) if r["model_position"] == 0 else (r["reference"], r["model"])
    assert judge.ask_judge(server["url"] + "/v1", tiny["policy"], None, r["prompt"], first, second, True) == r["answer"]
    # the completions come from the model: vLLM's greedy completions are HF generate's
    proc = run_script(JUDGE, *common, "--generator", "vllm", "--output", "vllm.jsonl", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(line)["model"] for line in open(tmp_path / "vllm.jsonl")] == [r["model"] for r in rows]
    assert any(r["model"].strip() for r in rows)


@pytest.mark.slow
def test_the_judge_refuses_bad_input_in_one_line_before_generating(tiny, server, tmp_path):
    data = judge_data(tmp_path)
    (tmp_path / "taken.jsonl").write_text("mine\n")
    common = ["--model_name_or_path", tiny["policy"], "--dataset_name", data, "--judge_model", tiny["policy"]]
    url = server["url"] + "/v1"
    for args, needles in [
        (["--judge_base_url", f"http://127.0.0.1:{free_port()}/v1"], ["does not answer"]),
        (["--judge_base_url", url, "--judge_model", "gpt-4o-mini"], ["does not serve --judge_model gpt-4o-mini"]),
        (["--judge_base_url", url, "--reference_column", "summary"], ["no column 'summary'", "completion"]),
        (["--judge_base_url", url, "--dataset_split", "validation"], ["no split 'validation'"]),
        (["--judge_base_url", url, "--output", "taken.jsonl"], ["taken.jsonl exists"]),
        (
            ["--judge_base_url", url, "--max_new_tokens", "-3", "--output", "new.jsonl"],
            ["--max_new_tokens", "at least 1"],
        ),
        (["--judge_base_url", url, "--temperature", "-1", "--output", "new.jsonl"], ["--temperature"]),
        (["--judge_base_url", url, "--model_name_or_path", "./no_model"], ["could not load", "no_model"]),
    ]:
        check_one_line_error(run_script(JUDGE, *common, *args, cwd=tmp_path), *needles)
    assert (tmp_path / "taken.jsonl").read_text() == "mine\n"
    assert sorted(os.listdir(tmp_path)) == ["data", "taken.jsonl"]


@pytest.mark.slow
def test_the_judge_releases_its_output_when_it_fails_after_claiming_it(tiny, server, tmp_path, monkeypatch):
    """A failure while generating (here an out-of-memory error) leaves no empty --output to block the rerun."""

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(judge, "generate_hf", out_of_memory)
    args = [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        judge_data(tmp_path),
        "--judge_model",
        tiny["policy"],
        "--judge_base_url",
        server["url"] + "/v1",
        "--generator",
        "hf",
        "--output",
        str(tmp_path / "wins.jsonl"),
    ]
    with pytest.raises(RuntimeError, match="out of memory"):
        judge.main(args)
    assert not (tmp_path / "wins.jsonl").exists()


@pytest.mark.slow
def test_the_trl_comparison_runs_both_trainers_on_the_same_work(tmp_path):
    """Quick mode on the test model: rloo.py and TRL 1.16's RLOOTrainer (in its own environment, .venv-trl, which the
    README's test command makes) each run 6 updates; the table and the PNG come from their real logs."""
    trl_python = os.path.join(ROOT, ".venv-trl", "bin", "python")
    assert os.access(trl_python, os.X_OK), "make TRL's environment first: see benchmark/requirements-trl.txt"
    proc = run_script(
        os.path.join(ROOT, "benchmark", "trl_side_by_side.py"),
        "--preset",
        "tiny",
        "--quick",
        "--seed",
        "2",
        "--output",
        "trl.png",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "trl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "preset tiny, seed 2: 6 updates" in proc.stdout
    header = next(line for line in proc.stdout.splitlines() if "TRL / rloo.py" in line)
    assert "rloo.py" in header and "TRL 1.16.0 RLOOTrainer" in header
    for label in ("seconds per update", "peak memory (GiB)"):
        ours, theirs, ratio = (
            float(x)
            for x in next(line for line in proc.stdout.splitlines() if line.startswith(label))[len(label) :].split()
        )
        # The table prints two decimals and the ratio comes from the unrounded values: it lies in what they allow.
        assert ours > 0 and theirs > 0
        assert (theirs - 0.005) / (ours + 0.005) - 0.005 <= ratio <= (theirs + 0.005) / (ours - 0.005) + 0.005
    curves = [line for line in proc.stdout.splitlines() if line.startswith(("reward, ", "tokens per completion, "))]
    assert len(curves) == 4 and all(line.split()[-1] == "-" for line in curves)


@pytest.mark.slow
def test_the_trl_comparison_refuses_an_output_it_could_not_write_before_running(tmp_path):
    """An --output in a folder that cannot be made, or a PNG that exists, is one line before either trainer runs."""
    (tmp_path / "a_file").write_text("mine\n")
    (tmp_path / "taken.png").write_text("mine\n")
    script = os.path.join(ROOT, "benchmark", "trl_side_by_side.py")
    for output, needles in [
        ("a_file/curves.png", ["a_file/curves.png", "folder cannot be made"]),
        ("taken.png", ["taken.png must be a new .png file"]),
    ]:
        check_one_line_error(
            run_script(script, "--preset", "tiny", "--quick", "--output", output, cwd=tmp_path), *needles
        )
    assert (tmp_path / "a_file").read_text() == (tmp_path / "taken.png").read_text() == "mine\n"
    assert sorted(os.listdir(tmp_path)) == ["a_file", "taken.png"]


@pytest.mark.slow
def test_the_padding_free_benchmark_times_both_paths_side_by_side(tiny, prompts_file, tmp_path):
    """benchmark/padding_free.py on the test model: every stage of both paths, the workload's padding, each path's peak;
    --embedded runs rloo.py with each path and reads its stage timings."""
    script = os.path.join(ROOT, "benchmark", "padding_free.py")
    proc = subprocess.run(
        [
            sys.executable,
            script,
            "--model",
            tiny["policy"],
            "--batch",
            "8",
            "--max_completion_length",
            "16",
            "--per_device_train_batch_size",
            "4",
            "--rounds",
            "1",
        ],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 completions of 1..16 tokens (geometric)" in proc.stdout and "padding-free layout 'rows'" in proc.stdout
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[2:6]}
    assert sorted(rows) == sorted(["old_logprobs", "reference_forward", "reward", "policy_forward_backward"])
    # Wall-clock seconds: a bound (each stage's own, as the worker times it, is held by the test after this one); the
    # speed-up is padded over padding-free, within what the printed seconds' rounding allows
    for padded, packed, speed_up in rows.values():
        padded, packed, speed_up = float(padded), float(packed), float(speed_up.rstrip("x"))
        assert padded > 0 and packed > 0, proc.stdout
        assert (padded - 5e-4) / (packed + 5e-4) - 0.005 <= speed_up <= (padded + 5e-4) / (packed - 5e-4) + 0.005
    assert "peak memory (MiB)" in proc.stdout and "real tokens per micro-batch: [" in proc.stdout
    # The workload is the one it names: the first 2 prompts of the embedded dataset 4 times each under the chat
    # template, and completions of round(16^(i/7)) tokens, i = 0..7 (1 1 2 3 5 7 11 16: 46 tokens); so many real tokens
    # in 8 rows as wide as the widest prompt plus 16, and every real token in one of the 2 micro-batches of 4
    import re

    from datasets import load_dataset

    prompts = load_dataset("json", data_files=os.path.join(ROOT, "data", "movie_reviews", "train.jsonl"))["train"]
    prompt_ids, prompt_mask, _, _ = tokenize_prompts(
        tiny["tokenizer"], [p for p in prompts["prompt"][:2] for _ in range(4)], 512, "cpu"
    )
    real, padded, padding = re.search(
        r"(\d+) real tokens in (\d+) padded positions \((\d+)% padding\)", proc.stdout
    ).groups()
    assert (int(real), int(padded)) == (int(prompt_mask.sum()) + 46, 8 * (prompt_ids.shape[1] + 16)), proc.stdout
    assert int(padding) == round(100 * (1 - int(real) / int(padded)))
    micro, heaviest = re.search(r"real tokens per micro-batch: \[(.*)\] \(heaviest (\S+)x", proc.stdout).groups()
    micro = [int(n) for n in micro.split(",")]
    assert len(micro) == 2 and sum(micro) == int(real) and heaviest == f"{max(micro) / statistics.mean(micro):.2f}"
    proc = subprocess.run(
        [
            sys.executable,
            script,
            "--embedded",
            "--updates",
            "2",
            "--rounds",
            "1",
            "--keep",
            "kept",
            "--",
            "--model_name_or_path",
            tiny["policy"],
            "--dataset_name",
            prompts_file,
            "--max_completion_length",
            "8",
        ],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 2 updates a run, the first dropped: every stage of both paths read from the runs' logs (a stage they did not log
    # would read 0 and its speed-up nan)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("python rloo.py (the embedded default), 2 updates a run, 1 runs of each path,")
    stages = ["generation", "old_logprobs", "reference_forward", "reward", "policy_forward_backward", "optimizer"]
    assert [line.split()[0] for line in lines[2:]] == [*stages, "update"], proc.stdout
    logged = {}  # each path's run (kept): its second update's row
    for path in ("padded", "padding_free"):
        with open(tmp_path / "kept" / "runs" / f"{path}_0" / "metrics.jsonl") as f:
            logged[path] = [row for row in map(json.loads, f) if "episode" in row][1]
        # the update's seconds hold its stages', timed one after the other inside it
        assert logged[path]["time/update"] >= sum(logged[path]["time/" + stage] for stage in stages), logged[path]
    for line in lines[2:]:  # every figure is the runs' own, to the 3 decimals printed; the speed-up their ratio
        stage, padded, packed, speed_up = line.split()
        padded_logged, packed_logged = logged["padded"]["time/" + stage], logged["padding_free"]["time/" + stage]
        assert (float(padded), float(packed)) == pytest.approx((padded_logged, packed_logged), abs=5e-4), line
        assert float(speed_up.rstrip("x")) == pytest.approx(padded_logged / packed_logged, abs=5e-3), line
    check_one_line_error(run_script(script, "--batch", "0", cwd=tmp_path), "--batch must be 1 or more, got 0")
    check_one_line_error(run_script(script, "--keep", "more", cwd=tmp_path), "--keep keeps rloo.py's runs")
    assert os.listdir(tmp_path) == ["kept"]


def test_the_padding_free_benchmark_charges_each_stage_its_own_seconds(tiny, monkeypatch):
    """padding_free.py's worker: a stage's seconds are the mean over the timed updates of its own (the warm-up untimed),
    read here on a clock the test sets."""
    import padding_free

    # Each stage's start and end, update after update: old_logprobs takes 1 then 5 s, reference_forward 2 then 10,
    # reward 3 then 1, policy_forward_backward 4 then 20
    readings = iter([0, 1, 1, 3, 3, 6, 6, 10, 10, 15, 15, 25, 25, 26, 26, 46])
    monkeypatch.setattr(padding_free, "time", types.SimpleNamespace(perf_counter=lambda: float(next(readings))))
    cli = types.SimpleNamespace(
        model=tiny["policy"],
        batch=8,
        max_completion_length=16,
        spread="geometric",
        per_device_train_batch_size=4,
        local_rollout_forward_batch_size=16,
        updates=2,
    )
    result = padding_free.worker("padded", cli)
    assert result["seconds"] == {
        "old_logprobs": 3.0,
        "reference_forward": 6.0,
        "reward": 2.0,
        "policy_forward_backward": 12.0,
    }
    assert next(readings, None) is None  # each timed stage read the clock twice, nothing else did


@pytest.mark.slow
@pytest.mark.parametrize("before", ["49250cc", "9152136"])
def test_the_logprob_memory_benchmark_runs_the_code_it_compares_with(before, tiny, tmp_path):
    """benchmark/logprob_memory.py on the test model: the code each --before names (kept in the script) and rloo.py's
    own run a micro-batch's forward and backward, each in a process of its own, and the table has both peaks, each at
    least the micro-batch's logits, which every one of them holds whole at some point; what it saved is theirs."""
    script = os.path.join(ROOT, "benchmark", "logprob_memory.py")
    proc = subprocess.run(
        [
            sys.executable,
            script,
            "--model",
            tiny["policy"],
            "--before",
            before,
            "--batch",
            "16",
            "--prompt_length",
            "4",
            "--completion_lengths",
            "256",
        ],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"before: rloo.py as of commit {before}" in proc.stdout
    length, precision, before_mib, after_mib, saved = proc.stdout.strip().splitlines()[-1].split()
    assert (length, precision) == ("256", "fp32"), proc.stdout
    # The logits of 16 x 256 completion positions over the 400 words, fp32: the kept code's come whole from the model;
    # rloo.py's are made a chunk of 2^24 logits at a time on a CPU, one chunk here
    logits_mib = 16 * 256 * len(tiny["tokenizer"]) * 4 / 2**20
    assert logits_mib == 6.25
    before_mib, after_mib = float(before_mib), float(after_mib)  # printed to the MiB
    assert before_mib + 0.5 >= logits_mib and after_mib + 0.5 >= logits_mib, proc.stdout
    # what it saved is 1 - after / before, of the unrounded peaks: within what their rounding allows
    lowest, highest = 1 - (after_mib + 0.5) / (before_mib - 0.5), 1 - (after_mib - 0.5) / (before_mib + 0.5)
    assert lowest - 0.005 <= int(saved.rstrip("%")) / 100 <= highest + 0.005, proc.stdout
    assert os.listdir(tmp_path) == []
    header = ["completion", "precision", "before", "MiB", "after", "MiB", "saved"]
    assert proc.stdout.strip().splitlines()[-2].split() == header  # one row: one completion length, one precision
    # What it compares is the same computation: the code kept as --before gives the micro-batch it measures (a random
    # batch, temperature 0.7) the log-probs, entropies and gradient of rloo.py's completion_logprobs
    import logprob_memory
    import torch

    policy = logprob_memory.load_policy(tiny["policy"]).train()
    disable_dropout(policy)
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(policy.config.vocab_size, (2, 4), generator=generator)
    completion_ids = torch.randint(policy.config.vocab_size, (2, 8), generator=generator)
    computed = {}
    for implementation in [before, "after"]:
        logprobs, entropy = logprob_memory.IMPLEMENTATIONS[implementation](
            policy, prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids), 0.7, True
        )
        gradient = torch.autograd.grad(-logprobs.mean(), policy.model.embed_tokens.weight)[0]
        computed[implementation] = (logprobs.detach(), entropy.detach(), gradient)
    for kept, own in zip(computed[before], computed["after"]):
        torch.testing.assert_close(kept, own, rtol=1e-5, atol=1e-5)


# A step of logprob_memory.measure that holds a known tensor beside the tiny model's micro-batch of 2 x 8 tokens (about
# 1 MiB of its own): the ballast, 64 MiB written, kept by autograd until the backward
HOLDS_64_MIB = """
import sys, torch
sys.path.insert(0, {benchmark!r})
import logprob_memory

def with_ballast(policy, *batch, **options):
    logprobs, entropy = logprob_memory.IMPLEMENTATIONS["after"](policy, *batch, **options)
    ballast = torch.ones(16 * 2**20)
    return logprobs * ballast[-1], entropy

logprob_memory.IMPLEMENTATIONS["ballast"] = with_ballast
print(logprob_memory.measure("ballast", {model!r}, 2, 4, 8, False, False))
"""


@pytest.mark.slow
def test_the_logprob_memory_benchmark_s_peak_is_what_a_step_holds(tiny, tmp_path):
    """logprob_memory.measure in a process set up as the benchmark sets its workers up (glibc mapping every block of 64
    KiB or more on its own): a step that holds a 64 MiB tensor beside the tiny micro-batch's ~1 MiB reads as 64 MiB and
    that ~1 MiB, to within a MiB of pages, not 0 (the resident set after the step), nor the process's start-up and
    loading."""
    program = HOLDS_64_MIB.format(benchmark=os.path.join(ROOT, "benchmark"), model=tiny["policy"])
    proc = subprocess.run(
        [sys.executable, "-c", program],
        cwd=tmp_path,
        env={**run_env(), "MALLOC_MMAP_THRESHOLD_": "65536"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak_mib = int(proc.stdout.split()[-1]) / 2**20
    # The resident set is pages, not bytes allocated: during the step glibc may trim its heap's freed top and the kernel
    # may drop file-backed pages, so the 64 MiB can read ~0.1 MiB short (CI read 63.92 MiB once).
    assert 63 <= peak_mib < 64 + 8, proc.stdout


def test_the_accuracy_summary_adds_each_group_s_kl_clip_fraction_and_minutes(tmp_path, capsys):
    """accuracy_table.py --summary: a group's row alone, with the KL at its runs' last update (mean ± std), the clip
    fraction over all their updates, and the minutes a run took: wall_clock.json's where kept, else its training time
    at its last update (episode / eps); a run without a KL (beta 0) says n/a. --at_tokens least: every run where the
    run that generated the fewest tokens had its last evaluation."""
    import accuracy_table

    for name, (kls, clips, eps, seconds, length) in {
        "a__1": ([0.1, 0.2], [0.0, 0.5], 0.5, 150, 4.0),
        "a__2": ([0.3, 0.4], [0.25, 0.25], 0.5, None, 4.0),  # 64 episodes at 0.5 a second: 128 s
        "b__1": ([None, None], [0.0, 0.0], 1.0, None, 2.0),  # 2 updates of 32 completions of 2 tokens: 128 tokens
    }.items():
        updates = [
            {
                "step": 32 * u,
                "episode": 32 * u,
                "eps": eps,
                "completions/mean_length": length,
                "clip_ratio/region_mean": c,
            }
            | ({"kl": kl} if kl is not None else {})
            for u, kl, c in zip((1, 2), kls, clips)
        ]
        evaluation = [{"step": 0, "eval/pass@1": 0.25}, {"step": 64, "eval/pass@1": 0.5}]
        write_jsonl(str(tmp_path / name / "metrics.jsonl"), [evaluation[0], *updates, evaluation[1]])
        if seconds:
            (tmp_path / name / "wall_clock.json").write_text(json.dumps({"seconds": seconds}))
    assert accuracy_table.main(["--runs", str(tmp_path), "--regex", r"^(.+)__\d+$", "--summary"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].endswith("| pass@1: first -> last | kl at the end | clip fraction | minutes per run |")
    # a: KL 0.2 and 0.4 at the end, clips (0, 0.5, 0.25, 0.25), 150 s and 128 s; b: no KL, no clip, 64 s
    assert rows[1:] == [
        "| **a** | **mean ± std of 2** | 256 ± 0 | 0.250 ± 0.000 -> 0.500 ± 0.000 | 0.300 ± 0.141 | 0.250 | 2.3 |",
        "| **b** | **mean ± std of 1** | 128 ± 0 | 0.250 ± 0.000 -> 0.500 ± 0.000 | n/a | 0.000 | 1.1 |",
    ]
    # at 128 tokens: a halfway from its first evaluation (0 tokens) to its last (256), b at its last
    assert accuracy_table.main(["--runs", str(tmp_path), "--regex", r"^(.+)__\d+$", "--at_tokens", "least"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| **")]
    assert [row.split(" | ")[3] for row in rows] == ["0.375 ± 0.000 |", "0.500 ± 0.000 |"]


# docs/algorithm.md's rows of the arithmetic comparison, and the run groups they come from
COMPARISON_ROWS = {
    "rloo (the default)": "rloo",
    "`--advantage_estimator grpo`": "grpo",
    "`--advantage_estimator dr_grpo`": "dr_grpo",
    "`--advantage_estimator reinforce_pp`": "reinforce_pp",
    "`--loss_type token --ppo_clip`": "token_ppo_clip",
    "`--loss_type cispo`": "cispo",
    "`--loss_type gspo`": "gspo",
    "`--loss_type sapo`": "sapo",
    "TRL 1.16 RLOOTrainer": "trl",
}


def page_table(text: str, heading: str) -> dict[str, list[str]]:
    """The markdown table after the line that starts with heading: {first cell: the other cells}."""
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    rows = [line for line in lines[start + 2 :] if line.startswith("| ")][: len(COMPARISON_ROWS)]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in row.strip("|").split("|")] for row in rows)}


def test_the_arithmetic_comparison_s_tables_are_the_kept_runs_numbers(capsys):
    """docs/algorithm.md's comparison on the arithmetic task is 27 kept runs (benchmark/results/compare_arithmetic:
    9 configurations x 3 seeds) as accuracy_table.py reads them: after 40 updates (greedy pass@1, pass@1, pass@8, KL,
    clip fraction, minutes) and at the fewest tokens any run generated. A run added, lost or changed, or a number of
    the page edited by hand, fails here."""
    import accuracy_table

    page = open(os.path.join(ROOT, "docs", "algorithm.md")).read()
    results = os.path.join(ROOT, "benchmark", "results", "compare_arithmetic")
    assert sorted(os.listdir(results)) == sorted(f"{g}__{s}" for g in COMPARISON_ROWS.values() for s in (1, 2, 3))
    regex = ["--runs", results, "--regex", r"^(.+)__\d+$", "--summary"]
    for extra, heading, columns in [
        ([], "After 40 updates, mean ± std", [3, 4, 7, 8, 9, 10]),
        (["--at_tokens", "least"], "At equal generated tokens", [3, 4, 7]),
    ]:
        assert accuracy_table.main(regex + extra) == 0
        printed = {}
        for line in capsys.readouterr().out.splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[0] == "group" and extra:  # "greedy pass@1: at <tokens> tokens": the page says where it read
                assert f"{int(cells[3].split()[-2]):,}, the fewest any run generated" in page
            if line.startswith("| **"):
                assert cells[1] == "**mean ± std of 3**", line
                printed[cells[0].strip("*")] = [cells[i].split(" -> ")[-1] for i in columns]
        assert page_table(page, heading) == {row: printed[group] for row, group in COMPARISON_ROWS.items()}


@pytest.mark.slow
def test_the_accuracy_table_reads_first_and_last_evaluations_and_greedy_tables(tmp_path):
    """benchmark/accuracy_table.py: each run's pass@k at its first and last evaluation, greedy pass@1 as the mean reward
    of its first and last sample tables, the completion tokens generated (a run of --dynamic_sampling: every round's),
    each group's mean ± std; one line when no run has two evaluations or the regular expression is not one."""
    for name, (first, last) in {"rloo__1__1": (0.2, 0.6), "rloo__2__1": (0.4, 0.8), "other__1__1": (0.0, 0.0)}.items():
        run = tmp_path / "runs" / name
        update = {"step": 32, "episode": 32, "reward": 0.5, "completions/mean_length": 5.0}
        if name == "rloo__2__1":
            update["sampling/generated_tokens"] = 300.0
        write_jsonl(
            str(run / "metrics.jsonl"),
            [
                {"step": 0, "eval/pass@1": first, "eval/pass@8": first + 0.1},
                update,
                {"step": 64, "eval/pass@1": last, "eval/pass@8": last + 0.1},
            ],
        )
        write_jsonl(str(run / "samples.jsonl"), [{"step": s, "reward": r} for s in (0, 64) for r in (s > 0, 0.0)])
    table = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmark", "accuracy_table.py"), "--runs", tmp_path / "runs"]
        + ["--regex", "^(rloo)__"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert table.returncode == 0, table.stderr
    rows = [line for line in table.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == (
        "| group | run | tokens generated | greedy pass@1: first -> last | pass@1: first -> last | "
        "pass@8: first -> last |"
    )
    assert rows[1] == "| rloo | rloo__1__1 | 160 | 0.000 -> 0.500 | 0.200 -> 0.600 | 0.300 -> 0.700 |"
    assert rows[2] == "| rloo | rloo__2__1 | 300 | 0.000 -> 0.500 | 0.400 -> 0.800 | 0.500 -> 0.900 |"
    assert rows[-1] == (
        "| **rloo** | **mean ± std of 2** | 230 ± 99 | 0.000 ± 0.000 -> 0.500 ± 0.000 | 0.300 ± 0.141 -> 0.700 ± 0.141 | "
        "0.400 ± 0.141 -> 0.800 ± 0.141 |"
    )
    # where each run had generated 80 tokens: halfway from its first evaluation (0 tokens) to its last (160; 300)
    at = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmark", "accuracy_table.py"), "--runs", tmp_path / "runs"]
        + ["--regex", "^(rloo)__", "--at_tokens", "200"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = [line for line in at.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].endswith("| pass@1: at 200 tokens | pass@8: at 200 tokens |")
    assert rows[1] == "| rloo | rloo__1__1 | 160 | not reached | not reached | not reached |"
    assert rows[2] == "| rloo | rloo__2__1 | 300 | 0.333 | 0.667 | 0.767 |"  # 2/3 of the way from 0.4 to 0.8
    assert rows[3] == (
        "| **rloo** | **mean ± std of 2** | 230 ± 99 | 0.333 ± 0.000 (1 of 2 reached it) | "
        "0.667 ± 0.000 (1 of 2 reached it) | 0.767 ± 0.000 (1 of 2 reached it) |"
    )
    none = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmark", "accuracy_table.py"), "--runs", tmp_path, "--regex", "^x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert none.returncode == 1 and none.stderr.count("\n") == 1 and "no run in" in none.stderr
    unbalanced = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmark", "accuracy_table.py"), "--runs", tmp_path, "--regex", "(rloo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unbalanced.returncode == 2 and "--regex '(rloo' is not a regular expression" in unbalanced.stderr
    assert "Traceback" not in unbalanced.stderr


def test_trl_s_logged_steps_become_rloo_py_s_update_rows():
    """benchmark/trl_arithmetic.py: an update of two optimizer steps is one row: its generation's reward, lengths and
    tokens (TRL logs them on the step that generates), and the mean of the two steps' KL, clip fraction and entropy."""
    import trl_arithmetic

    steps = [
        {
            "episode": 32,
            "seconds": 3.0,
            "trl": {
                "reward": 0.25,
                "completions/mean_length": 12.0,
                "num_tokens": 900.0,
                "kl": 0.0,
                "clip_ratio/region_mean": 0.0,
                "entropy": 2.0,
                "loss": 0.5,
            },
        },
        {
            "episode": 32,
            "seconds": 1.0,
            "trl": {"kl": 0.5, "clip_ratio/region_mean": 0.25, "entropy": 1.0, "loss": -0.5},
        },
        {
            "episode": 64,
            "seconds": 2.0,
            "trl": {
                "reward": 0.75,
                "completions/mean_length": 8.0,
                "num_tokens": 1700.0,
                "kl": 1.0,
                "clip_ratio/region_mean": 0.0,
                "entropy": 1.5,
                "loss": 0.0,
            },
        },
        {"episode": 64, "seconds": 2.0, "trl": {"kl": 2.0, "clip_ratio/region_mean": 0.5, "entropy": 0.5, "loss": 1.0}},
    ]
    assert trl_arithmetic.update_rows(steps, 2) == [
        {"episode": 32, "global_step": 2, "reward": 0.25, "completions/mean_length": 12.0, "num_tokens": 900.0,
         "kl": 0.25, "clip_ratio/region_mean": 0.125, "entropy": 1.5, "loss": 0.0, "time/update": 4.0},
        {"episode": 64, "global_step": 4, "reward": 0.75, "completions/mean_length": 8.0, "num_tokens": 1700.0,
         "kl": 1.5, "clip_ratio/region_mean": 0.25, "entropy": 1.0, "loss": 0.5, "time/update": 4.0},
    ]  # fmt: skip


def test_trl_arithmetic_refuses_a_seed_another_process_is_running(tmp_path, monkeypatch):
    """Two trl_arithmetic.py in one --out would train one seed into one folder: the second says so in one line, and
    leaves the first's folder as it is."""
    import fcntl

    import trl_arithmetic

    folder = tmp_path / "runs" / "trl__1"
    folder.mkdir(parents=True)
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "model.safetensors").write_text("")  # the model folder made: nothing to convert
    (folder / "trl_steps.jsonl").write_text("theirs\n")
    with open(folder / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        monkeypatch.setattr(sys, "argv", ["trl_arithmetic.py", "--seeds", "1", "--out", str(tmp_path)])
        with pytest.raises(SystemExit) as refused:
            trl_arithmetic.main()
    assert str(refused.value).startswith("trl_arithmetic.py: error: ") and "is still running" in str(refused.value)
    assert (folder / "trl_steps.jsonl").read_text() == "theirs\n"


def test_trl_arithmetic_with_every_seed_kept_needs_neither_trl_nor_the_model(tmp_path, monkeypatch, capsys):
    """A fresh clone rebuilds the comparison from its kept runs: with every seed in --results, trl_arithmetic.py says
    so for each, without TRL's environment and without converting the model into --out; a seed not kept still needs
    TRL, refused in one line before anything is made."""
    import trl_arithmetic

    results, out = tmp_path / "results", tmp_path / "out"
    for seed in (1, 2):
        (results / f"trl__{seed}").mkdir(parents=True)
        (results / f"trl__{seed}" / "metrics.jsonl").write_text('{"step": 0}\n')
    argv = ["trl_arithmetic.py", "--out", str(out), "--results", str(results), "--trl_python", str(tmp_path / "none")]
    monkeypatch.setattr(sys, "argv", [*argv, "--seeds", "1", "2"])
    trl_arithmetic.main()
    assert capsys.readouterr().out.splitlines() == [f"trl__{seed}: kept in {results}" for seed in (1, 2)]
    assert not out.exists()
    monkeypatch.setattr(sys, "argv", [*argv, "--seeds", "1", "3"])
    with pytest.raises(SystemExit) as refused:
        trl_arithmetic.main()
    assert str(refused.value) == (
        f"trl_arithmetic.py: error: --trl_python {tmp_path / 'none'} is not there: make TRL's environment as "
        "trl_baseline.py says"
    )
    assert not out.exists()


@pytest.mark.slow
def test_trl_arithmetic_evaluates_a_saved_model_as_rloo_py_evaluates_it(tiny, tmp_path):
    """The initial model's held-out evaluation and greedy sample table, from benchmark/trl_arithmetic.py's evaluate,
    are rloo.py's own before its first update on the arithmetic preset, number for number (the seconds apart)."""
    import trl_arithmetic

    train = run_script(
        os.path.join(ROOT, "rloo.py"),
        *trl_arithmetic.PRESET,
        *("--model_name_or_path", tiny["policy"], "--total_episodes", 32, "--seed", 3, "--run_name", "r"),
        cwd=tmp_path,
    )
    assert train.returncode == 0, train.stdout + train.stderr
    logger, _ = trl_arithmetic.evaluate(tiny["policy"], 3, 0, str(tmp_path / "e"), None)
    logger.close()
    theirs, ours = ({"metrics.jsonl": [], "samples.jsonl": []} for _ in range(2))
    for folder, tables in [(tmp_path / "runs" / "r", theirs), (tmp_path / "e", ours)]:
        for name in tables:
            rows = [json.loads(line) for line in open(folder / name)]
            tables[name] = [{k: v for k, v in r.items() if k != "eval/seconds"} for r in rows if r["step"] == 0]
    assert len(theirs["samples.jsonl"]) == 60 and len(theirs["metrics.jsonl"]) == 1
    assert "eval/pass@8" in theirs["metrics.jsonl"][0] and ours == theirs


def test_the_startup_benchmark_knows_the_first_line_runs_py_prints_and_tables_the_seconds():
    """benchmark/startup.py stops a run at the line rloo_utils/set_up.py's first_line makes (here made by it, so that a
    change to that line shows), at no other, and tables each kind's median, min and max seconds and its CPU seconds."""
    import types

    import startup

    from rloo_utils.set_up import first_line

    for world_size, checkpoint in [(1, None), (2, "runs/x/checkpoints/2")]:
        plan = types.SimpleNamespace(num_updates=3, batch_size=16, checkpoint=checkpoint)
        line = first_line(plan, "runs/r__1__7", types.SimpleNamespace(type="cpu"), 4, 3, False, world_size)
        assert startup.is_first_line(line)
    assert not startup.is_first_line("cached a de-quantised copy of a.gguf in b: later runs start from it")
    assert not startup.is_first_line("held-out evaluation on 16 prompts of split test x 4 completions")
    assert startup.table(
        {"cold": [3.0, 1.0, 2.0], "warm": [0.52]}, {"cold": [2, 1, 9], "warm": [0.4]}
    ).splitlines() == [
        "| start-up | runs | median s | min s | max s | median CPU s |",
        "|---|---|---|---|---|---|",
        "| cold (an empty cache: the file, and its copy made) | 3 | 2.0 | 1.0 | 3.0 | 2.0 |",
        "| warm (the copy) | 1 | 0.5 | 0.5 | 0.5 | 0.4 |",
    ]
    assert 0 < startup.cpu_seconds(os.getpid()) < time.process_time() + 1


@pytest.mark.slow
def test_the_startup_benchmark_times_the_file_the_copy_made_and_the_copy(tiny, tiny_gguf, prompts_file, tmp_path):
    """benchmark/startup.py on the tiny GGUF: a row for each kind of run, one run of each, stopped at its first line;
    a policy that is no .gguf file is refused (no copy made: nothing to time), and nothing is left behind."""
    script = os.path.join(ROOT, "benchmark", "startup.py")
    proc = run_script(
        script, "--rounds", 1, "--", "--model_name_or_path", tiny_gguf, "--dataset_name", prompts_file, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split(":")[0] for line in proc.stdout.splitlines()[:3]] == [
        "round 1, off",
        "round 1, cold",
        "round 1, warm",
    ]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ") and "runs" not in line]
    assert [row[0].split()[1] for row in rows] == ["off", "cold", "warm"]
    assert all(row[1] == "1" and 0 < float(row[2]) == float(row[3]) == float(row[4]) for row in rows)
    assert all(0 < float(row[5].strip(" |")) for row in rows)
    no_gguf = ["--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file]
    check_one_line_error(
        run_script(script, "--rounds", 1, "--no_off", "--", *no_gguf, cwd=tmp_path),
        "startup.py: error: the cold run made no copy of its policy: is it a .gguf file",
    )
    check_one_line_error(
        run_script(
            script, "--rounds", 1, "--no_off", "--", "--model_name_or_path", os.path.join(ROOT, "nothing"), cwd=tmp_path
        ),
        "printed no first line",
    )
    check_one_line_error(run_script(script, "--rounds", 0, cwd=tmp_path), "--rounds must be 1 or more, got 0")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("task", ["embedded", "arithmetic"])
def test_the_token_budget_benchmark_compares_settings_rloo_accepts(task):
    """benchmark/token_budget.py's settings: fixed rows and budgets of the same guarantee (rows x the longest row the
    options allow), and one of a quarter of an update's tokens; each a command rloo.py's checks accept."""
    import importlib.util

    import tyro

    import rloo
    from rloo_utils.checks import check_args

    spec = importlib.util.spec_from_file_location("token_budget", os.path.join(ROOT, "benchmark", "token_budget.py"))
    token_budget = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(token_budget)
    rows, longest, options = token_budget.TASKS[task]
    settings = token_budget.settings(rows, longest, mean_quarter=50)
    assert len(settings) == 5
    budgets = []
    for name, extra in settings.items():
        args = tyro.cli(rloo.Args, args=[*options, *extra, "--total_episodes", str(rows)], use_underscores=True)
        check_args(args)
        assert args.max_prompt_length + args.max_completion_length == longest
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        assert per_step == rows, name  # every setting trains the same rows an optimizer step
        budgets.append(args.max_tokens_per_micro_batch)
    assert budgets == [None, rows * longest, None, rows // 4 * longest, longest]  # the quarter: at least the longest


def test_the_math_reward_benchmark_s_workload_is_the_mix_it_says():
    """benchmark/math_reward_speed.py's completions: groups of 8 sharing a gold answer, LaTeX and integer golds, boxed
    fractions, answers without a box, and a few long reasoning texts."""
    import math_reward_speed

    golds, completions = math_reward_speed.workload(400)
    assert len(golds) == len(completions) == 400
    assert all(len(set(golds[i : i + 8])) == 1 for i in range(0, 400, 8))
    assert {type(g) for g in golds} == {str, int} and any(g.startswith("$\\frac") for g in golds if isinstance(g, str))
    assert any("\\boxed{\\dfrac" in c for c in completions) and any("\\boxed" not in c for c in completions)
    long = [c for c in completions if len(c) > 3000]
    assert 0 < len(long) < 40 and all(c.endswith("}$.") for c in long)


@pytest.mark.slow
def test_the_math_reward_benchmark_times_every_way_on_the_same_scores(tmp_path):
    """On 48 completions, once: a row for math-verify in-process and one for each number of workers, the scores agreed
    (the script exits otherwise), the JSON written where --out says; a folder that does not exist is refused."""
    from rloo_utils.math_judge import WORKERS

    script = os.path.join(ROOT, "benchmark", "math_reward_speed.py")
    out = tmp_path / "speed.json"
    proc = run_script(script, "--completions", 48, "--repeats", 1, "--out", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["workers"] for row in result["rows"]] == [0, 0, 1, 2][: 2 + WORKERS]
    assert all(row["seconds_per_1000"] > 0 for row in result["rows"]) and result["completions"] == 48
    assert 0.3 < result["share_right"] < 1
    assert "| math-verify in this process, main thread, a gold parsed per completion (TRL's way) |" in proc.stdout
    check_one_line_error(
        run_script(script, "--out", tmp_path / "no" / "x.json", cwd=tmp_path), "--out", "its folder does not exist"
    )


def test_the_sandbox_speed_benchmark_scores_both_modes_side_by_side(tmp_path):
    """benchmark/sandbox_speed.py on 4 completions (2 right, 1 wrong, 1 raising; 3 tests each): every mode and number
    of workers in its table and its JSON, each scoring them alike."""
    import sandbox_speed

    out = tmp_path / "speed.json"
    argv = ["--completions", "4", "--rounds", "1", "--python", "/usr/bin/python3", "--out", str(out)]
    record = sandbox_speed.main(sandbox_speed.parse_args(argv))
    assert list(record["table"]) == ["bwrap, 1 worker", "bwrap, 2 workers", "rlimits, 1 worker", "rlimits, 2 workers"]
    assert record["test_runs"] == 12
    for row in record["table"].values():
        assert row["mean_reward"] == 0.5 and row["completions_per_second"] == 4 / row["seconds"] > 0
    assert json.loads(out.read_text())["table"] == record["table"]
