"""openrlbenchmark's own code, run as benchmark/experiments/openrlbenchmark_trl.py prints it, on a real W&B run of
rloo.py that a local stand-in of the W&B API serves (tests/wandb_api_standin.py): a metric or a config key renamed in
the scripts breaks this test, not the plot next to TRL's runs."""

import csv
import glob
import json
import os
import shlex
import shutil
import struct
import subprocess
import sys

import pytest

from conftest import ROOT, read_metrics, run_rloo
from wandb_api_standin import WandbApiStandin, read_offline_run

pytestmark = pytest.mark.slow  # every test of this file starts a run (tests/conftest.py)

VENV = os.path.join(ROOT, ".venv-openrlbenchmark")  # openrlbenchmark pins rich and tyro below this project's
INSTALL = (
    "python -m venv .venv-openrlbenchmark && "
    ".venv-openrlbenchmark/bin/pip install -r benchmark/requirements-openrlbenchmark.txt"
)
COMMAND_SCRIPT = os.path.join(ROOT, "benchmark", "experiments", "openrlbenchmark_trl.py")
# The 14 panels of TRL's RLOO docs plot
METRICS = [
    "train/objective/rlhf_reward",
    "train/objective/scores",
    "train/objective/kl",
    "train/objective/non_score_reward",
    "train/objective/entropy",
    "train/policy/approxkl_avg",
    "train/policy/clipfrac_avg",
    "train/loss/policy_avg",
    "train/policy/entropy_avg",
    "train/val/ratio",
    "train/val/ratio_var",
    "train/val/num_eos_tokens",
    "train/lr",
    "train/eps",
]
# TRL's public TL;DR run as TRL's RLOO docs select it (project huggingface/trl, config output_dir and sft_model_path,
# tag pr-1540). wandb.ai cannot be reached here: a copy of our run's history stands in for it under TRL's keys.
TRL_ENV_ID = "models/minimal/rloo_tldr"
TRL_RUN = {
    "entity": "huggingface",
    "project": "trl",
    "tags": ["pr-1540"],
    "config": {"output_dir": TRL_ENV_ID, "sft_model_path": "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr"},
}


@pytest.fixture(scope="module")
def logged(tiny, tmp_path_factory):
    """rloo.py with --track (W&B offline), 4 updates on the tiny model with the default --dataset_name, 2 epochs of
    2 minibatches as benchmark/experiments/tldr.sh (with one of each val/ratio_var is NaN on every row, and
    openrlbenchmark's table, which drops rows holding a NaN, shows NaN for every metric). It evaluates on the dataset's
    test split after updates 0, 2 and 4: W&B keeps an evaluation in the row of its step, the first one in a row of its
    own (step 0)."""
    cwd = tmp_path_factory.mktemp("tracked")
    proc = run_rloo(
        "--model_name_or_path",
        tiny["policy"],
        "--track",
        "--total_episodes",
        32,
        "--per_device_train_batch_size",
        4,
        "--num_mini_batches",
        2,
        "--num_ppo_epochs",
        2,
        "--max_completion_length",
        8,
        "--num_sample_generations",
        0,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = glob.glob(str(cwd / "runs" / "*"))
    run = read_offline_run(run_dir)
    assert run["state"] == "finished" and len(run["history"]) == 5
    (run_dir,) = glob.glob(str(cwd / "runs" / "*"))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        evaluations = [row for row in map(json.loads, f) if "eval/reward" in row]
    return {"run": run, "metrics": read_metrics(cwd), "evaluations": evaluations}


def run_openrlbenchmark(ours: dict, env_id: str, tmp_path, command=None):
    """The command openrlbenchmark_trl.py prints (or `command`, given its arguments after the python), run as printed
    against the stand-in serving our run (ours, under local/rloo) and TRL's. openrlbenchmark caches each run it scans
    in its package folder (dataset/<entity>/<project>/<run id>/ and an offline.sqlite per project) and reads that cache
    before the server: it runs from a fresh copy of its package, so no run reads another's cache and the environment
    stays as installed."""
    assert os.access(os.path.join(VENV, "bin", "python"), os.X_OK), f"openrlbenchmark is not installed; run: {INSTALL}"
    (package,) = glob.glob(os.path.join(VENV, "lib", "python3*", "site-packages", "openrlbenchmark"))
    shutil.copytree(
        package, tmp_path / "site" / "openrlbenchmark", ignore=shutil.ignore_patterns("dataset", "__pycache__")
    )
    printed = subprocess.run(
        [
            sys.executable,
            COMMAND_SCRIPT,
            "--entity",
            "local",
            "--project",
            "rloo",
            "--exp_names",
            "rloo",
            "--env_id",
            env_id,
            "--output_filename",
            str(tmp_path / "compare"),
            "--python",
            os.path.join(VENV, "bin", "python"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert printed.returncode == 0, printed.stderr
    command = (
        [os.path.join(VENV, "bin", "python"), *command] if command else shlex.split(printed.stdout.replace("\\\n", " "))
    )
    assert command[1:3] == ["-m", "openrlbenchmark.rlops_multi_metrics"], printed.stdout
    home = tmp_path / "home"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "WANDB_CONFIG_DIR": str(home / "wandb"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "MPLBACKEND": "Agg",
        "PYTHONPATH": str(tmp_path / "site"),
        "WANDB_API_KEY": "0" * 40,
        "WANDB_ERROR_REPORTING": "false",
    }
    with WandbApiStandin([{**ours, "entity": "local", "project": "rloo"}, {**ours, **TRL_RUN}]) as standin:
        proc = subprocess.run(
            command,
            env={**env, "WANDB_BASE_URL": standin.url},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
    return command, proc


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def test_openrlbenchmark_plots_our_run_next_to_trls_with_every_metric(logged, tmp_path):
    run = logged["run"]
    command, proc = run_openrlbenchmark(run, run["config"]["dataset_name"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    groups = [command[i + 1] for i, word in enumerate(command) if word == "--filters"]
    assert [g.split("?")[1].split("&metrics=")[1:] for g in groups] == [METRICS, METRICS]
    assert "local/rloo/rloo ({}) has 1 runs" in proc.stdout
    for name in ["compare.png", "compare-time.png"]:  # over episodes, and over time
        width, height = png_size(tmp_path / name)
        assert width > 1000 and height > 1000 and os.path.getsize(tmp_path / name) > 50_000
    # The result table (mean ± std of the last rows, one row a group) is filed under the first group's env id
    with open(tmp_path / "compare" / f"{TRL_ENV_ID}.csv") as f:
        header, *rows = list(csv.reader(f))
    assert header[1:] == METRICS
    (ours,) = [row for row in rows if row[0].startswith("local/rloo/rloo")]
    assert all("nan" not in cell for cell in ours[1:]), dict(zip(header, ours))
    # What openrlbenchmark read of our run is what rloo.py logged
    with open(tmp_path / "site" / "openrlbenchmark" / "dataset" / "local" / "rloo" / run["id"] / "run_df.csv") as f:
        scanned = [r for r in csv.DictReader(f) if r["train/episode"]]  # (not the evaluation before training)
    assert [float(r["train/episode"]) for r in scanned] == [m["episode"] for m in logged["metrics"]]
    for name in METRICS:
        assert [float(r[name]) for r in scanned] == pytest.approx([m[name[len("train/") :]] for m in logged["metrics"]])


def renamed(run: dict, what: str) -> dict:
    if what == "metric":
        rows = [
            {k.replace("train/objective/scores", "train/objective/score"): v for k, v in row.items()}
            for row in run["history"]
        ]
        return {**run, "history": rows}
    config = {("dataset" if k == "dataset_name" else k): v for k, v in run["config"].items()}
    return {**run, "config": config}


@pytest.mark.parametrize("what", ["metric", "config key"])
def test_a_renamed_metric_or_config_key_fails_the_comparison(logged, tmp_path, what):
    """The same run with train/objective/scores logged as train/objective/score, or dataset_name saved as dataset:
    openrlbenchmark finds no such metric, or no run of our env id, and fails."""
    run = logged["run"]
    _, proc = run_openrlbenchmark(renamed(run, what), run["config"]["dataset_name"], tmp_path)
    assert proc.returncode != 0
    if what == "metric":
        assert "KeyError" in proc.stderr and "train/objective/scores" in proc.stderr, proc.stderr[-3000:]
    else:
        assert f"rloo ({{}}) in {run['config']['dataset_name']} has no runs" in proc.stderr, proc.stderr[-3000:]
    assert not os.path.exists(tmp_path / "compare.png")


def test_openrlbenchmark_plots_the_held_out_evaluation(logged, tmp_path):
    """The evaluation's metrics, by their W&B names (docs/metrics.md), over W&B's step (the episode, as every row
    of ours is logged at): openrlbenchmark reads what rloo.py logged."""
    run = logged["run"]
    metrics = ["eval/reward", "eval/best@4", "eval/completions/mean_length"]
    group = "?we=local&wpn=rloo&xaxis=_step&ceik=dataset_name&cen=exp_name" + "".join(f"&metrics={m}" for m in metrics)
    command = [
        "-m",
        "openrlbenchmark.rlops_multi_metrics",
        "--filters",
        group,
        "rloo",
        "--env-ids",
        run["config"]["dataset_name"],
        "--output-filename",
        str(tmp_path / "held_out"),
        "--scan-history",
    ]
    _, proc = run_openrlbenchmark(run, run["config"]["dataset_name"], tmp_path, command)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert png_size(tmp_path / "held_out.png")[0] > 500
    with open(tmp_path / "site" / "openrlbenchmark" / "dataset" / "local" / "rloo" / run["id"] / "run_df.csv") as f:
        scanned = [r for r in csv.DictReader(f) if r["eval/reward"]]
    assert [int(float(r["_step"])) for r in scanned] == [m["step"] for m in logged["evaluations"]] == [0, 16, 32]
    for name in metrics:
        assert [float(r[name]) for r in scanned] == pytest.approx([m[name] for m in logged["evaluations"]])
