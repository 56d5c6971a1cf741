"""Checkpoints, resume and faults: an interrupted run loses nothing, and the resumed run is the run it would have been.

The runs are real subprocesses of rloo.py, stopped by real signals. Where a test must stop a run inside a checkpoint
save, or make a save fail, it starts rloo.py through PATCHED: the same script, with torch.save replaced.
"""

import errno
import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, check_one_line_error, run_env, run_outcome, run_rloo

import rloo

REWARDS = os.path.join(ROOT, "tests", "reward_fixtures.py")
SCRIPT = os.path.join(ROOT, "rloo.py")

# rloo.py with torch.save replaced for the file whose path holds TARGET: "block" writes part of it and then hangs
# (for a SIGKILL in the middle of a save), "fail" raises the error a full disk gives.
PATCHED = """
import errno, os, runpy, sys, time, torch
mode, target, script = sys.argv[1:4]
sys.argv = sys.argv[3:]
save = torch.save
def patched(obj, f, *args, **kwargs):
    if target in str(f):
        if mode == "block":
            open(f, "wb").write(b"half a checkpoint")
            time.sleep(600)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
    return save(obj, f, *args, **kwargs)
torch.save = patched
runpy.run_path(script, run_name="__main__")
"""


def train_args(tiny, data, *extra, save_steps=3):
    """6 updates (N = 3, 2N = 6) of 2 epochs x 2 minibatches, KL to a reference, sample tables: every piece of state."""
    return ["--model_name_or_path", tiny["policy"], "--dataset_name", data, "--reward_funcs", f"{REWARDS}:slow_text_length",
            "--total_episodes", 48, "--per_device_train_batch_size", 4, "--num_mini_batches", 2, "--num_ppo_epochs", 2,
            "--max_completion_length", 8, "--learning_rate", 3e-3, "--beta", 0.1, "--num_sample_generations", 2,
            "--save_steps", save_steps, "--run_name", "run", *extra]


def start(cwd, *args, patch=None):
    """Start rloo.py (through PATCHED if patch = (mode, target)) in the background; output goes to files in cwd."""
    command = [sys.executable, "-c", PATCHED, *patch, SCRIPT] if patch else [sys.executable, SCRIPT]
    return subprocess.Popen(command + list(map(str, args)), cwd=cwd, env=run_env(),
                            stdout=open(os.path.join(cwd, "stdout.txt"), "w"), stderr=open(os.path.join(cwd, "stderr.txt"), "w"))


def wait_until(condition, proc, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, "the run ended before the test could interrupt it"
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def logged_updates(cwd) -> int:
    path = os.path.join(cwd, "runs", "run", "metrics.jsonl")
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def checkpoint_names(cwd) -> list[str]:
    return sorted(os.listdir(os.path.join(cwd, "runs", "run", "checkpoints")))


def outcome(cwd):
    return run_outcome(os.path.join(cwd, "runs", "run"))


def assert_same_run(expected, got):
    assert [r["episode"] for r in got[0]] == [r["episode"] for r in expected[0]]  # no step twice, none missing
    assert got[0] == expected[0]  # every metric of every step, exactly
    assert got[1] == expected[1]
    assert got[2].keys() == expected[2].keys()
    assert all(torch.equal(got[2][k], expected[2][k]) for k in expected[2])  # the same final weights, bit for bit


@pytest.fixture(scope="module")
def reference(tiny, prompts_file, tmp_path_factory):
    """The run of 2N updates, never interrupted."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    proc = run_rloo(*train_args(tiny, prompts_file), cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = outcome(cwd)
    assert len(result[0]) == 6 and result[0][-1]["kl"] > 0 and result[0][-1]["advantages/std"] > 0  # it learns something
    return result


def test_sigkill_after_checkpoint_then_resume_is_the_same_run(reference, tiny, prompts_file, tmp_path):
    proc = start(tmp_path, *train_args(tiny, prompts_file))
    wait_until(lambda: logged_updates(tmp_path) >= 4, proc)  # past checkpoint-3, before the end
    proc.kill()
    assert proc.wait() == -signal.SIGKILL
    assert 4 <= logged_updates(tmp_path) < 6 and checkpoint_names(tmp_path) == ["checkpoint-3"]

    resumed = run_rloo(*train_args(tiny, prompts_file, "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {os.path.join('runs', 'run', 'checkpoints', 'checkpoint-3')}" in " ".join(resumed.stdout.split())
    assert_same_run(reference, outcome(tmp_path))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "runs" / "run"))
    events.Reload()  # both processes' event files: purge_step hides the first one's rows past checkpoint-3
    assert [(e.step, e.value) for e in events.Scalars("train/reward")] == \
        [(r["episode"], pytest.approx(r["reward"])) for r in reference[0]]

    # What the finished run folder refuses, each before any model loads
    checkpoint_3 = os.path.join("runs", "run", "checkpoints", "checkpoint-3")
    check_one_line_error(run_rloo(*train_args(tiny, prompts_file, "--resume_from_checkpoint", checkpoint_3), cwd=tmp_path),
                         "has a newer checkpoint", "checkpoint-6", "which resuming from")
    check_one_line_error(run_rloo(*train_args(tiny, prompts_file, "--learning_rate", 1e-3, "--resume_from_checkpoint",
                                              "latest"), cwd=tmp_path), "--learning_rate is 0.001 here but 0.003 in")
    check_one_line_error(run_rloo(*train_args(tiny, prompts_file), cwd=tmp_path),
                         "runs/run exists already", "--resume_from_checkpoint latest --run_name run")


def test_sigkill_during_a_save_leaves_no_checkpoint_resume_trusts(reference, tiny, prompts_file, tmp_path):
    proc = start(tmp_path, *train_args(tiny, prompts_file), patch=("block", "tmp-checkpoint-6"))
    partial = tmp_path / "runs" / "run" / "checkpoints" / "tmp-checkpoint-6" / rloo.TRAINING_STATE
    wait_until(partial.exists, proc)  # checkpoint-6 half written
    proc.kill()
    assert proc.wait() == -signal.SIGKILL
    assert checkpoint_names(tmp_path) == ["checkpoint-3", "tmp-checkpoint-6"]

    resumed = run_rloo(*train_args(tiny, prompts_file, "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(reference, outcome(tmp_path))  # `latest` took checkpoint-3, not the half-written one
    assert checkpoint_names(tmp_path) == ["checkpoint-3", "checkpoint-6"]


def test_sigterm_writes_a_checkpoint_and_its_command_resumes_the_same_run(reference, tiny, prompts_file, tmp_path):
    # save_steps 0: the only checkpoint is the one SIGTERM asks for; --track: W&B (offline) continues the same run id
    proc = start(tmp_path, *train_args(tiny, prompts_file, "--track", save_steps=0))
    wait_until(lambda: logged_updates(tmp_path) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 128 + signal.SIGTERM
    stdout = (tmp_path / "stdout.txt").read_text()
    (saved,) = checkpoint_names(tmp_path)
    assert f"stopped by SIGTERM after update {saved.split('-')[1]} of 6" in stdout
    assert "Traceback" not in (tmp_path / "stderr.txt").read_text()

    command = shlex.split(stdout.split("Continue the run with:\n")[1].splitlines()[0])
    assert command[0] == "python" and command[-2:] == ["--resume_from_checkpoint", os.path.join("runs", "run", "checkpoints", saved)]
    resumed = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, env=run_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(reference, outcome(tmp_path))
    offline_runs = glob.glob(str(tmp_path / "runs" / "run" / "wandb" / "offline-run-*"))
    assert len(offline_runs) == 2 and len({path.rsplit("-", 1)[1] for path in offline_runs}) == 1


def test_sigint_checkpoints_and_keeps_the_newest(tiny, prompts_file, tmp_path):
    proc = start(tmp_path, *train_args(tiny, prompts_file, "--save_total_limit", 2, save_steps=1))
    wait_until(lambda: logged_updates(tmp_path) >= 3, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 128 + signal.SIGINT
    update = logged_updates(tmp_path)
    assert update < 6 and checkpoint_names(tmp_path) == [f"checkpoint-{update - 1}", f"checkpoint-{update}"]
    assert "stopped by SIGINT" in (tmp_path / "stdout.txt").read_text()


def test_a_failed_save_is_an_error_naming_the_path_and_the_earlier_checkpoint_stays(tiny, prompts_file, tmp_path):
    proc = start(tmp_path, *train_args(tiny, prompts_file), patch=("fail", "tmp-checkpoint-6"))
    proc.wait(timeout=300)
    proc.stderr = (tmp_path / "stderr.txt").read_text()
    check_one_line_error(proc, "could not write checkpoint runs/run/checkpoints/checkpoint-6", "No space left on device",
                         "the earlier checkpoints are intact")
    assert checkpoint_names(tmp_path) == ["checkpoint-3"]  # the temporary folder is gone, checkpoint-3 is whole
    state = torch.load(tmp_path / "runs" / "run" / "checkpoints" / "checkpoint-3" / rloo.TRAINING_STATE, weights_only=True)
    assert state["update"] == 3


# ------------------------------------------------------------------------------------------------------------------
# The helpers, in-process
# ------------------------------------------------------------------------------------------------------------------
def make_checkpoint(folder, complete=True):
    os.makedirs(folder)
    if complete:
        open(os.path.join(folder, rloo.TRAINING_STATE), "w").close()


def test_latest_ignores_incomplete_checkpoint_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = os.path.join("runs", "r", "checkpoints")
    make_checkpoint(os.path.join(folder, "checkpoint-2"))
    make_checkpoint(os.path.join(folder, "checkpoint-10"))
    make_checkpoint(os.path.join(folder, "tmp-checkpoint-12"))  # a save that was killed
    make_checkpoint(os.path.join(folder, "checkpoint-14"), complete=False)  # copied in part
    newest = os.path.join(folder, "checkpoint-10")
    assert rloo.find_checkpoint("latest", "r") == os.path.join("runs", "r", "checkpoints", "checkpoint-10")
    assert rloo.find_checkpoint(os.path.join("runs", "r"), None) == newest  # a run folder: its newest
    assert rloo.find_checkpoint(newest, None) == newest
    with pytest.raises(rloo.UsageError, match="has a newer checkpoint"):
        rloo.find_checkpoint(os.path.join(folder, "checkpoint-2"), None)
    with pytest.raises(rloo.UsageError, match="is not a complete checkpoint"):
        rloo.find_checkpoint(os.path.join(folder, "checkpoint-14"), None)
    os.makedirs(os.path.join("runs", "empty", "checkpoints", "tmp-checkpoint-1"))
    with pytest.raises(rloo.UsageError, match="has no complete checkpoint"):
        rloo.find_checkpoint("latest", "empty")


def test_a_failed_save_keeps_the_earlier_checkpoint_byte_for_byte(tiny, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    state = {"update": 1, "rng": rloo.rng_states()}
    first = str(tmp_path / "checkpoint-1")
    rloo.save_checkpoint(first, policy, tiny["tokenizer"], rloo.Args(), state)
    before = {p: open(p, "rb").read() for p in glob.glob(first + "/**", recursive=True) if os.path.isfile(p)}

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full_disk)
    second = str(tmp_path / "checkpoint-2")
    with pytest.raises(rloo.RunError, match=f"could not write checkpoint {second} .*No space left on device"):
        rloo.save_checkpoint(second, policy, tiny["tokenizer"], rloo.Args(), state)
    after = {p: open(p, "rb").read() for p in glob.glob(first + "/**", recursive=True) if os.path.isfile(p)}
    assert after == before and sorted(os.listdir(tmp_path)) == ["checkpoint-1"]


def test_rng_states_survive_a_save_and_load(tmp_path):
    import random

    import numpy as np

    rloo.set_rng_states(rloo.rng_states())  # accepted as produced
    torch.save(rloo.rng_states(), tmp_path / "rng.pt")
    draw = lambda: (random.random(), float(np.random.rand()), float(torch.rand(1)), torch.multinomial(torch.ones(50), 5).tolist())  # noqa: E731
    expected = draw()
    draw()
    rloo.set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draw() == expected


def test_optimizer_step_skips_a_non_finite_gradient_or_loss():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    weights = [p.detach().clone() for p in model.parameters()]

    model(torch.randn(3, 4)).sum().backward()
    model.bias.grad[0] = torch.nan  # injected
    grad_norm, stepped = rloo.optimizer_step(model, optimizer, 1.0, torch.tensor(1.0))
    assert not stepped and grad_norm.isnan()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights)) and not optimizer.state
    assert all(p.grad is None for p in model.parameters())  # the broken gradient does not leak into the next step

    model(torch.randn(3, 4)).sum().backward()
    assert not rloo.optimizer_step(model, optimizer, 1.0, torch.tensor(float("inf")))[1]  # finite gradient, inf loss
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))

    model(torch.randn(3, 4)).sum().backward()
    assert rloo.optimizer_step(model, optimizer, 1.0, torch.tensor(1.0))[1]
    assert not torch.equal(model.weight, weights[0])


def test_resume_command_replaces_an_earlier_resume_option():
    argv = ["rloo.py", "--seed", "2", "--resume_from_checkpoint", "old", "--run_name", "my run", "--resume_from_checkpoint=x"]
    assert rloo.resume_command(argv, "runs/r/checkpoints/checkpoint-4") == \
        "python rloo.py --seed 2 --run_name 'my run' --resume_from_checkpoint runs/r/checkpoints/checkpoint-4"


def test_check_resumable_allows_only_options_that_change_nothing(tmp_path):
    args = rloo.resolve_defaults(rloo.Args())
    with open(tmp_path / "args.json", "w") as f:
        json.dump(rloo.asdict(args), f)
    rloo.check_resumable(rloo.replace(args, save_steps=7, track=True, run_name="x", resume_from_checkpoint="latest"),
                         str(tmp_path))
    with pytest.raises(rloo.UsageError, match="--num_generations is 8 here but 4 in"):
        rloo.check_resumable(rloo.replace(args, num_generations=8), str(tmp_path))
    with pytest.raises(rloo.UsageError, match="--reward_funcs is"):
        rloo.check_resumable(rloo.replace(args, reward_funcs=["completion_length"]), str(tmp_path))


# ------------------------------------------------------------------------------------------------------------------
# Non-finite values, end to end
# ------------------------------------------------------------------------------------------------------------------
def test_skipped_steps_in_a_row_stop_the_run(tiny, prompts_file, tmp_path):
    proc = run_rloo("--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file, "--reward_funcs",
                    f"{REWARDS}:huge", "--beta", 0, "--total_episodes", 64, "--per_device_train_batch_size", 8,
                    "--max_completion_length", 8, "--num_sample_generations", 0, "--max_skipped_steps", 2,
                    "--run_name", "run", cwd=tmp_path)
    check_one_line_error(proc, "2 optimizer steps in a row had a non-finite loss or gradient (update 2)")
    assert logged_updates(tmp_path) == 1
    assert not os.path.exists(tmp_path / "runs" / "run" / "model")


def test_a_non_finite_reward_model_score_names_the_model(tiny, prompts_file, tmp_path):
    from transformers import AutoModelForSequenceClassification

    broken = AutoModelForSequenceClassification.from_pretrained(tiny["reward"])
    with torch.no_grad():
        broken.score.weight.fill_(torch.nan)
    broken.save_pretrained(tmp_path / "broken_rm")
    tiny["tokenizer"].save_pretrained(tmp_path / "broken_rm")
    proc = run_rloo("--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file, "--reward_model_path",
                    tmp_path / "broken_rm", "--num_sample_generations", 0, cwd=tmp_path)
    check_one_line_error(proc, "reward model broken_rm gave a non-finite score (nan) at index 0")
