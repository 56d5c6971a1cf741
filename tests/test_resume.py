"""Checkpoints, resume and faults: an interrupted run loses nothing, and the resumed run is the run it would have been.

The runs are real subprocesses of rloo.py, stopped by real signals. Where a test must stop a run inside a checkpoint
save, or make a save fail, it starts rloo.py through PATCHED: the same script, with torch.save replaced.
"""

import dataclasses
import errno
import glob
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import types
import time

import pytest
import torch

from conftest import ROOT, check_one_line_error, keywords_of, run_env, run_outcome, run_rloo

import rloo
from rloo_utils.checkpoints import (
    TRAINING_STATE,
    check_resumable,
    find_checkpoint,
    is_saved_model,
    load_checkpoint_weights,
    load_training_state,
    resume_command,
    rng_states,
    save_checkpoint,
    save_model,
    set_rng_states,
)
from rloo_utils.errors import RunError, UsageError
from rloo_utils.lifecycle import OUTPUT_CLAIM, claim_output_dir, claim_run, claim_run_dir, lock_run_dir
from rloo_utils.lora import add_adapter
from rloo_utils.models import optimizer_step
from rloo_utils.options import resumable_options

REWARDS = os.path.join(ROOT, "tests", "reward_fixtures.py")
SCRIPT = os.path.join(ROOT, "rloo.py")

# rloo.py with torch.save and safetensors' save_file (which save_pretrained uses) replaced for the file whose path
# holds TARGET: "block" writes part of it and then hangs (for a SIGKILL in the middle of a save), "fail" raises the
# error a full disk gives.
PATCHED = """
import errno, os, runpy, sys, time, torch, safetensors.torch
mode, target, script = sys.argv[1:4]
sys.argv = sys.argv[3:]
def patch(save):
    def patched(obj, f, *args, **kwargs):
        if target in str(f):
            if mode == "block":
                open(f, "wb").write(b"half a checkpoint")
                time.sleep(600)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return save(obj, f, *args, **kwargs)
    return patched
torch.save = patch(torch.save)
safetensors.torch.save_file = patch(safetensors.torch.save_file)  # before transformers imports it
sys.path.insert(0, os.path.dirname(script))  # as `python rloo.py` does: rloo_utils/ beside it
runpy.run_path(script, run_name="__main__")
"""


def train_args(tiny, data, *extra, save_steps=3):
    """6 updates (N = 3, 2N = 6) of 2 epochs x 2 minibatches, KL to a reference, sample tables: every piece of state."""
    return [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        data,
        "--reward_funcs",
        f"{REWARDS}:slow_text_length",
        "--total_episodes",
        48,
        "--per_device_train_batch_size",
        4,
        "--num_mini_batches",
        2,
        "--num_ppo_epochs",
        2,
        "--max_completion_length",
        8,
        "--learning_rate",
        3e-3,
        "--beta",
        0.1,
        "--num_sample_generations",
        2,
        "--save_steps",
        save_steps,
        "--run_name",
        "run",
        *extra,
    ]


def start(cwd, *args, patch=None):
    """Start rloo.py (through PATCHED if patch = (mode, target)) in the background; output goes to files in cwd."""
    command = [sys.executable, "-c", PATCHED, *patch, SCRIPT] if patch else [sys.executable, SCRIPT]
    return subprocess.Popen(
        command + list(map(str, args)),
        cwd=cwd,
        env=run_env(),
        stdout=open(os.path.join(cwd, "stdout.txt"), "w"),
        stderr=open(os.path.join(cwd, "stderr.txt"), "w"),
    )


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


def weights_moved(weights: dict, model_folder: str) -> bool:
    """Whether a run's saved weights (run_outcome's) differ from those of the model it started from (its
    model.safetensors, every tensor of which the run saved): the policy trained."""
    from safetensors.torch import load_file

    initial = load_file(os.path.join(model_folder, "model.safetensors"))
    assert initial.keys() <= weights.keys(), sorted(initial.keys() - weights.keys())
    return any(not torch.equal(weights[k], initial[k]) for k in initial)


def assert_same_run(expected, got):
    assert [r["step"] for r in got[0]] == [r["step"] for r in expected[0]]  # no step twice, none missing
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
    assert len(result[0]) == 6 and weights_moved(result[2], tiny["policy"])  # it learns something
    assert result[0][-1]["kl"] != 0 and result[0][-1]["advantages/std"] > 0  # (k1: a KL of either sign)
    return result


@pytest.mark.slow
def test_sigkill_after_checkpoint_then_resume_is_the_same_run(reference, tiny, prompts_file, tmp_path):
    proc = start(tmp_path, *train_args(tiny, prompts_file))
    wait_until(lambda: logged_updates(tmp_path) >= 4, proc)  # past checkpoint-3, before the end
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert 4 <= logged_updates(tmp_path) < 6 and checkpoint_names(tmp_path) == ["checkpoint-3"]

    resumed = run_rloo(*train_args(tiny, prompts_file, "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {os.path.join('runs', 'run', 'checkpoints', 'checkpoint-3')}" in " ".join(
        resumed.stdout.split()
    )
    assert_same_run(reference, outcome(tmp_path))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "runs" / "run"))
    events.Reload()  # both processes' event files: purge_step hides the first one's rows past checkpoint-3
    assert [(e.step, e.value) for e in events.Scalars("train/reward")] == [
        (r["episode"], pytest.approx(r["reward"])) for r in reference[0]
    ]

    # What the finished run folder refuses, each before any model loads
    checkpoint_3 = os.path.join("runs", "run", "checkpoints", "checkpoint-3")
    check_one_line_error(
        run_rloo(*train_args(tiny, prompts_file, "--resume_from_checkpoint", checkpoint_3), cwd=tmp_path),
        "has a newer checkpoint",
        "checkpoint-6",
        "which resuming from",
    )
    check_one_line_error(
        run_rloo(
            *train_args(tiny, prompts_file, "--learning_rate", 1e-3, "--resume_from_checkpoint", "latest"), cwd=tmp_path
        ),
        "--learning_rate is 0.001 here but 0.003 in",
    )
    check_one_line_error(
        run_rloo(*train_args(tiny, prompts_file), cwd=tmp_path),
        "runs/run exists already",
        "--resume_from_checkpoint latest --run_name run",
    )


@pytest.mark.slow
def test_sigkill_during_a_save_leaves_no_checkpoint_resume_trusts(reference, tiny, prompts_file, tmp_path):
    proc = start(
        tmp_path, *train_args(tiny, prompts_file), patch=("block", os.path.join("tmp-checkpoint-6", TRAINING_STATE))
    )
    partial = tmp_path / "runs" / "run" / "checkpoints" / "tmp-checkpoint-6" / TRAINING_STATE
    wait_until(partial.exists, proc)  # checkpoint-6 half written
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert checkpoint_names(tmp_path) == ["checkpoint-3", "tmp-checkpoint-6"]

    resumed = run_rloo(*train_args(tiny, prompts_file, "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(reference, outcome(tmp_path))  # `latest` took checkpoint-3, not the half-written one
    assert checkpoint_names(tmp_path) == ["checkpoint-3", "checkpoint-6"]


@pytest.mark.slow
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
    assert command[0] == "python" and command[-2:] == [
        "--resume_from_checkpoint",
        os.path.join("runs", "run", "checkpoints", saved),
    ]
    resumed = subprocess.run(
        [sys.executable, *command[1:]],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(reference, outcome(tmp_path))
    offline_runs = glob.glob(str(tmp_path / "runs" / "run" / "wandb" / "offline-run-*"))
    assert len(offline_runs) == 2 and len({path.rsplit("-", 1)[1] for path in offline_runs}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo.py", "rloo_multigpu.py"])
def test_sigterm_before_training_leaves_nothing_and_exits_143(script, tiny, prompts_file, tmp_path):
    """Between the run's claim of its folders and its first update (models loading): as on Ctrl-C the run removes what
    it made, but the exit code is SIGTERM's, 128 + 15, as after training started."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, script), *map(str, train_args(tiny, prompts_file))],
        cwd=tmp_path,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: os.path.exists(tmp_path / "runs" / "run" / "model" / OUTPUT_CLAIM), proc)
    time.sleep(0.2)  # the SIGTERM handler is set right after the claim; the models and transformers are still loading
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=300)[1]
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert f"{script}: error: interrupted before training started" in stderr and "Traceback" not in stderr, stderr
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")


@pytest.mark.slow
def test_sigint_checkpoints_and_keeps_the_newest(tiny, prompts_file, tmp_path):
    proc = start(tmp_path, *train_args(tiny, prompts_file, "--save_total_limit", 2, save_steps=1))
    wait_until(lambda: logged_updates(tmp_path) >= 3, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 128 + signal.SIGINT
    update = logged_updates(tmp_path)
    assert update < 6 and checkpoint_names(tmp_path) == [f"checkpoint-{update - 1}", f"checkpoint-{update}"]
    assert "stopped by SIGINT" in (tmp_path / "stdout.txt").read_text()


def hung_run_args(tiny, data, func, *extra):
    """3 updates whose reward function hangs from the second update on; no checkpoint but the ones a failure writes."""
    return [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        data,
        "--reward_funcs",
        f"{REWARDS}:{func}",
        "--total_episodes",
        48,
        "--per_device_train_batch_size",
        16,
        "--max_completion_length",
        8,
        "--num_sample_generations",
        0,
        "--save_steps",
        0,
        "--run_name",
        "run",
        *extra,
    ]


@pytest.mark.slow
def test_a_second_sigterm_stops_a_hung_update_and_keeps_the_last_complete_one(tiny, prompts_file, tmp_path):
    """The first SIGTERM waits for the update, which a hung reward never finishes; the second (a scheduler's grace
    period ending) stops at once, and the checkpoint of the last complete update is written all the same."""
    proc = start(tmp_path, *hung_run_args(tiny, prompts_file, "hangs_from_the_second_update"))
    wait_until(lambda: os.path.exists(tmp_path / "hanging"), proc)
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "finishing this update" in (tmp_path / "stdout.txt").read_text(), proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    stderr = (tmp_path / "stderr.txt").read_text()
    check_one_line_error(
        subprocess.CompletedProcess([], 143, "", stderr),
        "SIGTERM a second time: stopped at once",
        "the state after update 1 is in runs/run/checkpoints/checkpoint-1; continue with: python",
    )
    assert checkpoint_names(tmp_path) == ["checkpoint-1"] and logged_updates(tmp_path) == 1


@pytest.mark.slow
@pytest.mark.parametrize("func", ["hangs_from_the_second_update", "async_hangs_from_the_second_update"])
def test_a_reward_past_its_timeout_stops_the_run_and_keeps_the_last_complete_update(func, tiny, prompts_file, tmp_path):
    proc = run_rloo(*hung_run_args(tiny, prompts_file, func, "--reward_timeout", 3), cwd=tmp_path, timeout=300)
    check_one_line_error(
        proc,
        f"{func} did not return within --reward_timeout 3 s",
        "the state after update 1 is in runs/run/checkpoints/checkpoint-1; continue with: python",
    )
    assert proc.returncode == 1 and checkpoint_names(tmp_path) == ["checkpoint-1"] and logged_updates(tmp_path) == 1


def test_a_failed_save_is_an_error_naming_the_path_and_the_earlier_checkpoint_stays(tiny, prompts_file, tmp_path):
    proc = start(tmp_path, *train_args(tiny, prompts_file), patch=("fail", "tmp-checkpoint-6"))
    proc.wait(timeout=300)
    proc.stderr = (tmp_path / "stderr.txt").read_text()
    check_one_line_error(
        proc,
        "could not write checkpoint runs/run/checkpoints/checkpoint-6",
        "No space left on device",
        "the earlier checkpoints are intact",
    )
    assert checkpoint_names(tmp_path) == ["checkpoint-3"]  # the temporary folder is gone, checkpoint-3 is whole
    state = torch.load(tmp_path / "runs" / "run" / "checkpoints" / "checkpoint-3" / TRAINING_STATE, weights_only=True)
    assert state["update"] == 3


# ------------------------------------------------------------------------------------------------------------------
# The helpers, in-process
# ------------------------------------------------------------------------------------------------------------------
def make_checkpoint(folder, complete=True):
    os.makedirs(folder)
    if complete:
        open(os.path.join(folder, TRAINING_STATE), "w").close()


def test_latest_ignores_incomplete_checkpoint_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = os.path.join("runs", "r", "checkpoints")
    make_checkpoint(os.path.join(folder, "checkpoint-2"))
    make_checkpoint(os.path.join(folder, "checkpoint-10"))
    make_checkpoint(os.path.join(folder, "tmp-checkpoint-12"))  # a save that was killed
    make_checkpoint(os.path.join(folder, "checkpoint-14"), complete=False)  # copied in part
    newest = os.path.join(folder, "checkpoint-10")
    assert find_checkpoint("latest", "r") == os.path.join("runs", "r", "checkpoints", "checkpoint-10")
    assert find_checkpoint(os.path.join("runs", "r"), None) == newest  # a run folder: its newest
    assert find_checkpoint(newest, None) == newest
    with pytest.raises(UsageError, match="has a newer checkpoint"):
        find_checkpoint(os.path.join(folder, "checkpoint-2"), None)
    with pytest.raises(UsageError, match="is not a complete checkpoint"):
        find_checkpoint(os.path.join(folder, "checkpoint-14"), None)
    os.makedirs(os.path.join("runs", "empty", "checkpoints", "tmp-checkpoint-1"))
    with pytest.raises(UsageError, match="has no complete checkpoint"):
        find_checkpoint("latest", "empty")


def test_a_failed_save_keeps_the_earlier_checkpoint_byte_for_byte(tiny, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    state = {"update": 1, "rng": rng_states()}
    first = str(tmp_path / "checkpoint-1")
    options = dataclasses.asdict(rloo.Args())
    save_checkpoint(first, lambda folder: policy.save_pretrained(os.path.join(folder, "policy")), options, state)
    before = {p: open(p, "rb").read() for p in glob.glob(first + "/**", recursive=True) if os.path.isfile(p)}

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full_disk)
    second = str(tmp_path / "checkpoint-2")
    with pytest.raises(RunError, match=f"could not write checkpoint {second} .*No space left on device"):
        save_checkpoint(second, lambda folder: policy.save_pretrained(os.path.join(folder, "policy")), options, state)
    after = {p: open(p, "rb").read() for p in glob.glob(first + "/**", recursive=True) if os.path.isfile(p)}
    assert after == before and sorted(os.listdir(tmp_path)) == ["checkpoint-1"]


def test_rng_states_survive_a_save_and_load(tmp_path):
    import random

    import numpy as np

    set_rng_states(rng_states())  # accepted as produced
    torch.save(rng_states(), tmp_path / "rng.pt")
    draw = lambda: (
        random.random(),
        float(np.random.rand()),
        float(torch.rand(1)),
        torch.multinomial(torch.ones(50), 5).tolist(),
    )  # noqa: E731
    expected = draw()
    draw()
    set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draw() == expected


def test_optimizer_step_skips_a_non_finite_gradient_or_loss():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    weights = [p.detach().clone() for p in model.parameters()]

    model(torch.randn(3, 4)).sum().backward()
    model.bias.grad[0] = torch.nan  # injected
    grad_norm, stepped = optimizer_step(model, optimizer, 1.0, torch.tensor(1.0))
    assert not stepped and grad_norm.isnan()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights)) and not optimizer.state
    assert all(p.grad is None for p in model.parameters())  # the broken gradient does not leak into the next step

    model(torch.randn(3, 4)).sum().backward()
    assert not optimizer_step(model, optimizer, 1.0, torch.tensor(float("inf")))[1]  # finite gradient, inf loss
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))

    model(torch.randn(3, 4)).sum().backward()
    assert optimizer_step(model, optimizer, 1.0, torch.tensor(1.0))[1]
    assert not torch.equal(model.weight, weights[0])


def test_resume_command_replaces_an_earlier_resume_option():
    argv = [
        "rloo.py",
        "--seed",
        "2",
        "--resume_from_checkpoint",
        "old",
        "--run_name",
        "my run",
        "--resume_from_checkpoint=x",
    ]
    assert (
        resume_command(argv, "runs/r/checkpoints/checkpoint-4")
        == "python rloo.py --seed 2 --run_name 'my run' --resume_from_checkpoint runs/r/checkpoints/checkpoint-4"
    )


def test_check_resumable_allows_only_options_that_change_nothing(tmp_path):
    args = rloo.resolve_defaults(rloo.Args())
    with open(tmp_path / "args.json", "w") as f:
        json.dump(dataclasses.asdict(args), f)
    check_resumable(
        dataclasses.asdict(rloo.replace(args, save_steps=7, track=True, run_name="x", resume_from_checkpoint="latest")),
        str(tmp_path),
        resumable_options(rloo.Args),
    )
    with pytest.raises(UsageError, match="--num_generations is 8 here but 4 in"):
        check_resumable(
            dataclasses.asdict(rloo.replace(args, num_generations=8)), str(tmp_path), resumable_options(rloo.Args)
        )
    with pytest.raises(UsageError, match="--reward_funcs is"):
        check_resumable(
            dataclasses.asdict(rloo.replace(args, reward_funcs=["completion_length"])),
            str(tmp_path),
            resumable_options(rloo.Args),
        )


def test_generating_from_the_shards_is_not_resumable(tmp_path):
    """rloo_multigpu.py: a gathered policy generates on a static KV cache (auto on CUDA), a sharded one cannot, and the
    two sample other completions: --no_gather_for_generation may not change at resume (the timeout may)."""
    import rloo_multigpu

    args = rloo_multigpu.resolve_defaults(rloo_multigpu.Args())
    with open(tmp_path / "args.json", "w") as f:
        json.dump(dataclasses.asdict(args), f)
    resumable = resumable_options(rloo_multigpu.Args)
    check_resumable(dataclasses.asdict(rloo_multigpu.replace(args, ddp_timeout=60)), str(tmp_path), resumable)
    with pytest.raises(UsageError, match="--gather_for_generation is False here but True in"):
        check_resumable(
            dataclasses.asdict(rloo_multigpu.replace(args, gather_for_generation=False)), str(tmp_path), resumable
        )


# ------------------------------------------------------------------------------------------------------------------
# Non-finite values, end to end
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_skipped_steps_in_a_row_stop_the_run_after_a_checkpoint(tiny, prompts_file, tmp_path):
    proc = run_rloo(
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--reward_funcs",
        f"{REWARDS}:poisons_gradients",
        "--beta",
        0,
        "--total_episodes",
        64,
        "--per_device_train_batch_size",
        8,
        "--max_completion_length",
        8,
        "--num_sample_generations",
        0,
        "--max_skipped_steps",
        2,
        "--run_name",
        "run",
        cwd=tmp_path,
    )
    check_one_line_error(
        proc,
        "2 optimizer steps in a row had a non-finite loss or gradient (update 2)",
        "the state after update 2 is in runs/run/checkpoints/checkpoint-2; continue with: python",
    )
    assert logged_updates(tmp_path) == 2  # the update that reached the limit is logged (optim/skipped_steps shows it)
    assert checkpoint_names(tmp_path) == ["checkpoint-2"]
    assert json.loads(open(tmp_path / "runs" / "run" / "metrics.jsonl").readlines()[-1])["optim/skipped_steps"] == 2
    assert not os.path.exists(tmp_path / "runs" / "run" / "model" / "config.json")


@pytest.mark.slow
def test_a_non_finite_reward_model_score_names_the_model(tiny, prompts_file, tmp_path):
    from transformers import AutoModelForSequenceClassification

    broken = AutoModelForSequenceClassification.from_pretrained(tiny["reward"])
    with torch.no_grad():
        broken.score.weight.fill_(torch.nan)
    broken.save_pretrained(tmp_path / "broken_rm")
    tiny["tokenizer"].save_pretrained(tmp_path / "broken_rm")
    proc = run_rloo(
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--reward_model_path",
        tmp_path / "broken_rm",
        "--num_sample_generations",
        0,
        cwd=tmp_path,
    )
    check_one_line_error(proc, "reward model broken_rm gave a non-finite score (nan) at index 0")


# ------------------------------------------------------------------------------------------------------------------
# Nothing a run trained is lost: a failure after training leaves a checkpoint and the command that continues it
# ------------------------------------------------------------------------------------------------------------------
# A reward function that fails once, at the call number written in ./fail_at; otherwise len(text) / 10.
FAULTY = """
import os
calls = 0
def text_length(completions, **kwargs):
    global calls
    calls += 1
    if os.path.exists("fail_at") and int(open("fail_at").read()) == calls:
        os.remove("fail_at")
        raise RuntimeError("the judge is down")
    return [len(c if isinstance(c, str) else c[-1]["content"]) / 10 for c in completions]
"""


def faulty_args(tiny, data, *extra):
    """6 updates, 2 epochs x 2 minibatches, KL; the reward function is ./faulty.py (one call per update, and one per
    sample table: at episode 0 and after updates 3 and 6)."""
    return [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        data,
        "--reward_funcs",
        "faulty.py:text_length",
        "--total_episodes",
        48,
        "--per_device_train_batch_size",
        4,
        "--num_mini_batches",
        2,
        "--num_ppo_epochs",
        2,
        "--max_completion_length",
        8,
        "--learning_rate",
        3e-3,
        "--beta",
        0.1,
        "--num_sample_generations",
        2,
        "--run_name",
        "run",
        *extra,
    ]


def run_faulty(cwd, tiny, data, fail_at=None, *extra):
    (cwd / "faulty.py").write_text(FAULTY)
    if fail_at is not None:
        (cwd / "fail_at").write_text(str(fail_at))
    return run_rloo(*faulty_args(tiny, data, *extra), cwd=cwd)


def continue_command(error_line: str) -> list[str]:
    command = shlex.split(error_line.split("continue with: ")[1])
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


@pytest.fixture(scope="module")
def faulty_reference(tiny, prompts_file, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("faulty_uninterrupted")
    proc = run_faulty(cwd, tiny, prompts_file)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return outcome(cwd)


@pytest.mark.slow
def test_a_failure_after_training_writes_a_checkpoint_and_the_run_continues_exactly(
    faulty_reference, tiny, prompts_file, tmp_path
):
    # Call 6 is update 4's reward: the weights are still those after update 3, so checkpoint-3 is exact (--save_steps 0)
    proc = run_faulty(tmp_path, tiny, prompts_file, 6)
    error = check_one_line_error(
        proc,
        "reward function text_length raised RuntimeError: the judge is down",
        "the state after update 3 is in runs/run/checkpoints/checkpoint-3; continue with: python",
    )
    assert checkpoint_names(tmp_path) == ["checkpoint-3"] and logged_updates(tmp_path) == 3
    resumed = subprocess.run(
        continue_command(error), cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(faulty_reference, outcome(tmp_path))


@pytest.mark.slow
def test_a_failure_in_a_sample_table_keeps_the_update_before_it_whole(faulty_reference, tiny, prompts_file, tmp_path):
    # Call 5 scores the sample table after update 3, made at the start of update 4: update 3 is complete, so
    # checkpoint-3 is its exact state, and the resumed run makes that table again
    proc = run_faulty(tmp_path, tiny, prompts_file, 5)
    error = check_one_line_error(
        proc,
        "reward function text_length raised RuntimeError: the judge is down",
        "the state after update 3 is in runs/run/checkpoints/checkpoint-3; continue with: python",
    )
    assert checkpoint_names(tmp_path) == ["checkpoint-3"] and logged_updates(tmp_path) == 3
    resumed = subprocess.run(
        continue_command(error), cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(faulty_reference, outcome(tmp_path))  # the failed table's rows included


# rloo.py whose 14th optimizer step raises (update 4's second of 4: its first step is done), as an out-of-memory would
FAILING_STEP = """
import os, runpy, sys, torch
calls, step = [0], torch.optim.AdamW.step
def failing_step(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == 14:
        raise RuntimeError("CUDA out of memory")
    return step(self, *args, **kwargs)
torch.optim.AdamW.step = failing_step
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # as `python rloo.py` does: rloo_utils/ beside it
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_failure_inside_an_update_keeps_its_weights_and_the_run_continues(tiny, prompts_file, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", FAILING_STEP, SCRIPT, *map(str, train_args(tiny, prompts_file, save_steps=0))],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0 and "CUDA out of memory" in proc.stderr
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("rloo.py: error:")]
    assert (
        "update 4 was cut short: the weights and optimizer state it reached are in runs/run/checkpoints/checkpoint-4 "
        "(a resumed run"
    ) in error and "; continue with: python" in error
    state = torch.load(tmp_path / "runs" / "run" / "checkpoints" / "checkpoint-4" / TRAINING_STATE, weights_only=True)
    assert state["update"] == 4 and state["episode"] == 32
    assert state["scheduler"]["last_epoch"] == 13  # 3 updates x 2 epochs x 2 minibatches, and update 4's first step
    resumed = subprocess.run(
        continue_command(error), cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = outcome(tmp_path)[0]
    assert [r["episode"] for r in metrics] == [8, 16, 24, 40, 48]  # no update twice; update 4 never got to its log


@pytest.mark.slow
def test_a_run_that_trained_nothing_leaves_nothing_and_the_same_command_runs_again(tiny, prompts_file, tmp_path):
    proc = run_faulty(tmp_path, tiny, prompts_file, 1, "--output_dir", "out/model")  # the sample table at episode 0
    error = check_one_line_error(proc, "reward function text_length raised RuntimeError: the judge is down")
    assert "continue with" not in error
    assert not os.path.exists(tmp_path / "runs" / "run") and not os.path.exists(tmp_path / "out" / "model")
    again = run_faulty(tmp_path, tiny, prompts_file, None, "--output_dir", "out/model")
    assert again.returncode == 0, again.stderr[-3000:]
    assert is_saved_model(str(tmp_path / "out" / "model"))


@pytest.mark.slow
def test_a_failed_final_save_leaves_the_last_checkpoint_and_resuming_saves_the_model(
    reference, tiny, prompts_file, tmp_path
):
    proc = start(
        tmp_path, *train_args(tiny, prompts_file), patch=("fail", os.path.join("run", "model", "model.safetensors"))
    )
    proc.wait(timeout=300)
    proc.stderr = (tmp_path / "stderr.txt").read_text()
    error = check_one_line_error(
        proc,
        "could not save the trained model to runs/run/model",
        "No space left on device",
        "the state after update 6 is in runs/run/checkpoints/checkpoint-6",
    )
    resumed = subprocess.run(
        continue_command(error), cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(reference, outcome(tmp_path))


@pytest.mark.slow
def test_a_resume_while_the_run_is_still_running_is_refused(tiny, prompts_file, tmp_path):
    long_run = ("--total_episodes", 4800)  # 600 updates: still running when the second process starts, on any machine
    proc = start(tmp_path, *train_args(tiny, prompts_file, *long_run, save_steps=1))
    try:
        wait_until(lambda: os.path.isdir(tmp_path / "runs" / "run" / "checkpoints" / "checkpoint-1"), proc)
        second = run_rloo(
            *train_args(tiny, prompts_file, *long_run, "--resume_from_checkpoint", "latest", save_steps=1), cwd=tmp_path
        )
        check_one_line_error(second, "runs/run is in use by another run", f"(pid {proc.pid})")
    finally:
        proc.kill()
        proc.wait(timeout=60)


def test_a_run_that_went_on_after_its_newest_checkpoint_was_found_is_not_resumed(tmp_path, monkeypatch):
    """Found "latest", then the run wrote a newer checkpoint (and ended) before this process took the lock: resuming
    from the older one would train updates again over the newer one's folder. Refused once the lock is held."""
    monkeypatch.chdir(tmp_path)
    folder = os.path.join("runs", "run", "checkpoints")
    make_checkpoint(os.path.join(folder, "checkpoint-4"))
    found = find_checkpoint("latest", "run")
    make_checkpoint(os.path.join(folder, "checkpoint-5"))  # the other run, meanwhile
    args = rloo.Args(run_name="run", resume_from_checkpoint="latest")
    with pytest.raises(UsageError, match="has a newer checkpoint, .*checkpoint-5, which resuming from"):
        plan = types.SimpleNamespace(checkpoint=found, training_state=None, options=dataclasses.asdict(args))
        claim_run(args, plan, 8)
    assert sorted(os.listdir(folder)) == ["checkpoint-4", "checkpoint-5"]  # nothing of the run touched


@pytest.mark.slow
def test_an_existing_file_as_output_dir_is_refused_before_training_and_kept(tiny, prompts_file, tmp_path):
    (tmp_path / "notes.txt").write_text("my notes")
    proc = run_rloo(*train_args(tiny, prompts_file, "--output_dir", "notes.txt"), cwd=tmp_path)
    check_one_line_error(proc, "--output_dir notes.txt is a file, not a folder")
    assert (tmp_path / "notes.txt").read_text() == "my notes"
    assert os.listdir(tmp_path / "runs") == []  # the run folder it had claimed is gone again


# ------------------------------------------------------------------------------------------------------------------
# Run and output folders: claimed atomically, never shared, never overwritten (in-process)
# ------------------------------------------------------------------------------------------------------------------
def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "time", lambda: 1700000000.5)
    args = rloo.Args()
    assert claim_run_dir(**keywords_of(claim_run_dir, args)) == os.path.join("runs", "rloo__1__1700000000")
    assert claim_run_dir(**keywords_of(claim_run_dir, args)) == os.path.join("runs", "rloo__1__1700000000_2")
    named = rloo.replace(args, run_name="mine")
    assert claim_run_dir(**keywords_of(claim_run_dir, named)) == os.path.join("runs", "mine")
    with pytest.raises(
        UsageError,
        match="runs/mine exists already and holds no checkpoint to continue from: "
        "choose another --run_name, or delete runs/mine",
    ):
        claim_run_dir(**keywords_of(claim_run_dir, named))
    make_checkpoint(os.path.join("runs", "mine", "checkpoints", "checkpoint-2"))
    with pytest.raises(UsageError, match="continue that run with --resume_from_checkpoint latest --run_name mine"):
        claim_run_dir(**keywords_of(claim_run_dir, named))


def test_a_run_folder_is_locked_by_one_process(tmp_path):
    lock = lock_run_dir(str(tmp_path))
    with pytest.raises(UsageError, match=f"is in use by another run \\(pid {os.getpid()}\\)"):
        lock_run_dir(str(tmp_path))  # a second open file: as another process would hold it
    lock.close()  # the process that held it ends
    lock_run_dir(str(tmp_path)).close()


def test_the_output_folder_is_new_empty_or_this_runs_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs(os.path.join("runs", "a"))
    os.makedirs(os.path.join("runs", "b"))
    assert claim_output_dir("new/model", "runs/a") is True  # created, and claimed
    assert json.load(open("new/model/rloo_run.json")) == {"run_dir": os.path.abspath("runs/a")}
    assert claim_output_dir("new/model", "runs/a") is False  # its own, as when the run is resumed
    with pytest.raises(UsageError, match="--output_dir new/model is not empty \\(claimed by runs/a\\)"):
        claim_output_dir("new/model", "runs/b")  # two runs never share an output folder
    os.makedirs("empty")
    assert claim_output_dir("empty", "runs/b") is False and os.listdir("empty") == ["rloo_run.json"]
    os.makedirs("adapter")
    open("adapter/adapter_model.safetensors", "w").close()
    with pytest.raises(UsageError, match="--output_dir adapter is not empty: it holds adapter_model.safetensors"):
        claim_output_dir("adapter", "runs/b")
    os.makedirs("stale")
    json.dump({"run_dir": os.path.abspath("runs/deleted")}, open("stale/rloo_run.json", "w"))
    assert claim_output_dir("stale", "runs/b") is False  # its run folder is gone: the claim is void
    open("notes.txt", "w").close()
    with pytest.raises(UsageError, match="--output_dir notes.txt is a file, not a folder"):
        claim_output_dir("notes.txt", "runs/b")
    with pytest.raises(UsageError, match="cannot create --output_dir notes.txt/model \\(NotADirectoryError"):
        claim_output_dir("notes.txt/model", "runs/b")
    with pytest.raises(UsageError, match="cannot create --output_dir /proc/rloo-test"):
        claim_output_dir("/proc/rloo-test", "runs/b")


def test_save_model_checks_that_the_model_was_written(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    save_model(str(tmp_path / "out"), policy, tiny["tokenizer"])
    assert is_saved_model(str(tmp_path / "out"))
    (tmp_path / "file").write_text("x")  # save_pretrained only logs a warning for a path that is a file
    with pytest.raises(RunError, match="could not save the trained model to .*file"):
        save_model(str(tmp_path / "file"), policy, tiny["tokenizer"])


# ------------------------------------------------------------------------------------------------------------------
# Damaged checkpoints and run folders: one line naming the file, before any model loads (in-process)
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def saved_run(tiny, tmp_path, monkeypatch):
    """runs/r with a real checkpoint-2 and its logs, in tmp_path (the working folder)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    run_dir = os.path.join("runs", "r")
    os.makedirs(run_dir)
    logs = {"metrics.jsonl": '{"step": 8}\n{"step": 16}\n', "samples.jsonl": '{"step": 0}\n'}
    for name, text in logs.items():
        open(os.path.join(run_dir, name), "w").write(text)
    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    optimizer = torch.optim.AdamW(policy.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    checkpoint = os.path.join(run_dir, "checkpoints", "checkpoint-2")
    args = rloo.resolve_defaults(rloo.Args(model_name_or_path=tiny["policy"]))

    def save_weights(folder):
        policy.save_pretrained(os.path.join(folder, "policy"))
        tiny["tokenizer"].save_pretrained(os.path.join(folder, "policy"))

    save_checkpoint(
        checkpoint,
        save_weights,
        dataclasses.asdict(args),
        {
            "update": 2,
            "episode": 16,
            "skipped_steps": 0,
            "skipped_in_a_row": 0,
            "seconds": 1.0,
            "rng": rng_states(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "logger": {"sizes": {name: len(text) for name, text in logs.items()}, "step": 16, "wandb_id": None},
        },
    )
    return args, run_dir, checkpoint


def test_a_sound_checkpoint_passes_the_checks(saved_run):
    args, run_dir, checkpoint = saved_run
    check_resumable(dataclasses.asdict(args), checkpoint, resumable_options(rloo.Args))
    assert load_training_state(checkpoint, run_dir, sharded=False)["update"] == 2


@pytest.mark.parametrize("use_peft", [False, True])
def test_a_checkpoint_with_non_finite_weights_is_refused(saved_run, tiny, use_peft):
    """A run never writes one (NonFiniteWeights stops it first); one from elsewhere must not be trained on."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    args, run_dir, checkpoint = saved_run
    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    folder = os.path.join(checkpoint, "policy")
    if use_peft:
        args = dataclasses.replace(args, use_peft=True, lora_target_modules=["q_proj"])
        policy = add_adapter(policy, **keywords_of(add_adapter, args, model_path=args.model_name_or_path))
        policy.save_pretrained(folder)
    path = os.path.join(folder, "adapter_model.safetensors" if use_peft else "model.safetensors")
    weights = load_file(path)
    name = sorted(k for k in weights if "lora_B" in k or not use_peft)[0]
    weights[name][0, 0] = math.nan
    save_file(weights, path, metadata={"format": "pt"})
    with pytest.raises(UsageError, match="checkpoint-2/policy holds non-finite weights: resume from an"):
        load_checkpoint_weights(policy, folder)


DAMAGE = [
    (
        lambda c, r: os.remove(os.path.join(c, "args.json")),
        "checkpoint-2/args.json is missing or damaged (FileNotFoundError",
    ),
    (
        lambda c, r: open(os.path.join(c, "args.json"), "w").write("{not json"),
        "checkpoint-2/args.json is missing or damaged (JSONDecodeError",
    ),
    (
        lambda c, r: open(os.path.join(c, "args.json"), "w").write("[]"),
        "args.json is missing or damaged (AssertionError: not a JSON object",
    ),
    (
        lambda c, r: open(os.path.join(c, TRAINING_STATE), "wb").write(b"half a checkpoint"),
        "training_state.pt is damaged",
    ),
    (
        lambda c, r: torch.save({"update": 2}, os.path.join(c, TRAINING_STATE)),
        "training_state.pt is damaged (AssertionError: it lacks episode",
    ),
    (
        lambda c, r: os.remove(os.path.join(c, "policy", "config.json")),
        "checkpoint-2/policy lacks config.json or its weights",
    ),
    (
        lambda c, r: os.remove(os.path.join(c, "policy", "model.safetensors")),
        "checkpoint-2/policy lacks config.json or its weights",
    ),
    (
        lambda c, r: os.remove(os.path.join(r, "metrics.jsonl")),
        "runs/r/metrics.jsonl is missing since runs/r/checkpoints/checkpoint-2",
    ),
    (lambda c, r: os.remove(os.path.join(r, "samples.jsonl")), "runs/r/samples.jsonl is missing since"),
    (lambda c, r: open(os.path.join(r, "metrics.jsonl"), "w").write("{}\n"), "runs/r/metrics.jsonl is shorter than at"),
]


@pytest.mark.parametrize(
    "damage,needle", DAMAGE, ids=[n.split(" is ")[0].split("/")[-1] + "-" + str(i) for i, (_, n) in enumerate(DAMAGE)]
)
def test_a_damaged_checkpoint_or_run_folder_is_one_line_naming_the_file(saved_run, damage, needle):
    args, run_dir, checkpoint = saved_run
    damage(checkpoint, run_dir)
    with pytest.raises(UsageError) as error:  # the checks of a resume, in the order rloo.py makes them
        check_resumable(dataclasses.asdict(args), checkpoint, resumable_options(rloo.Args))
        load_training_state(checkpoint, run_dir, sharded=False)
    assert needle in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_a_checkpoints_folder_that_cannot_be_created_is_a_save_error(tiny, prompts_file, tmp_path):
    proc = start(tmp_path, *train_args(tiny, prompts_file))
    wait_until(lambda: os.path.isdir(tmp_path / "runs" / "run"), proc)
    (tmp_path / "runs" / "run" / "checkpoints").write_text("a file where the folder should be")
    proc.wait(timeout=300)
    proc.stderr = (tmp_path / "stderr.txt").read_text()
    check_one_line_error(
        proc,
        "could not write checkpoint runs/run/checkpoints/checkpoint-3 (FileExistsError",
        "the earlier checkpoints are intact; saving what it trained failed too",
    )


@pytest.mark.slow
def test_a_damaged_training_state_is_refused_before_any_model_loads(saved_run, tiny, prompts_file):
    args, run_dir, checkpoint = saved_run
    open(os.path.join(checkpoint, TRAINING_STATE), "wb").write(b"half a checkpoint")
    proc = run_rloo(
        "--model_name_or_path", tiny["policy"], "--resume_from_checkpoint", "latest", "--run_name", "r", cwd=os.getcwd()
    )
    check_one_line_error(proc, "runs/r/checkpoints/checkpoint-2/training_state.pt is damaged")
