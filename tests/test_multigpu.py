"""rloo_multigpu.py on CPU: torchrun with 2 processes (gloo) and the tiny model, sharded by FSDP2.

A 2-process run learns and saves a loadable model; from the same rollouts it computes what one process computes for
the same global batch (metrics and weights); SIGTERM on one process checkpoints all of them and the resumed run is
the uninterrupted one; a failing process stops every process with one line; launch errors are one line.
"""

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from conftest import (
    ROOT,
    check_learned,
    check_one_line_error,
    free_port,
    learning_task,
    read_metrics,
    run_env,
    run_outcome,
    run_rloo,
    wait_for_updates,
    write_jsonl,
)

pytestmark = pytest.mark.slow  # every test of this file starts a run (tests/conftest.py)

REWARDS = os.path.join(ROOT, "tests", "reward_fixtures.py")
SCRIPT = os.path.join(ROOT, "rloo_multigpu.py")


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), SCRIPT]


def run_torchrun(nproc: int, *args, cwd, timeout=600, env=None) -> subprocess.CompletedProcess:
    """torchrun as a user runs it; on a timeout its workers are killed too (they are not in its process group)."""
    command = [*torchrun(nproc), *map(str, args)]
    proc = subprocess.Popen(
        command, cwd=cwd, env={**run_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            for pid in worker_pids(proc.pid).values():
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait(timeout=60)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def our_errors(stderr: str) -> list[str]:
    """The script's own error lines (torchrun adds its report of the failed processes after them), and no traceback of
    a process (torchrun's report is a traceback of its own, ending in ChildFailedError)."""
    assert stderr.count("Traceback (most recent call last)") == stderr.count("errors.ChildFailedError:"), stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("rloo_multigpu.py: error:")]


@pytest.mark.learning
def test_two_processes_raise_a_simple_reward_and_save_a_loadable_model(
    tiny, prompts_file, tmp_path, learning_seed, request
):
    from transformers import AutoModelForCausalLM

    task = learning_task(tiny["policy"], prompts_file, learning_seed, per_device_train_batch_size=16)
    proc = run_torchrun(2, *task, "--save_steps", 12, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [r["reward"] for r in read_metrics(tmp_path)]
    assert len(rewards) == 12  # 384 / (16 x 2 processes)
    check_learned(request, rewards, gain=1.0)
    (run,) = os.listdir(tmp_path / "runs")
    saved = tmp_path / "runs" / run / "model"
    with open(saved / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(saved)
    initial = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    assert not torch.equal(model.model.layers[1].mlp.up_proj.weight, initial.model.layers[1].mlp.up_proj.weight)
    # The shards both processes wrote to the last checkpoint make up the saved model (docs/multigpu.md's conversion)
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "runs" / run / "checkpoints" / "checkpoint-12" / "dcp", tmp_path / "policy.pt")
    gathered, saved_weights = torch.load(tmp_path / "policy.pt")["model"], load_file(saved / "model.safetensors")
    assert saved_weights.keys() == gathered.keys() - {
        "lm_head.weight"
    }  # the tied LM head saved once, as save_pretrained
    assert all(torch.equal(gathered[k], saved_weights[k]) for k in saved_weights)


def same_batch_args(tiny, data, per_device: int, *extra, accumulation: int = 2):
    """2 updates of a global batch of 32 (8 prompts x 4), 2 epochs of 1 minibatch of `accumulation` micro-batches a
    process, a token-mean loss (the case a per-process or per-micro-batch token count gets wrong), a KL and a sample
    table, an entropy bonus. Rollout chunks of 16 rows: one per process with 2 processes, the same two chunks with
    one."""
    return [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        data,
        "--reward_funcs",
        f"{REWARDS}:text_length",
        "--total_episodes",
        64,
        "--per_device_train_batch_size",
        per_device,
        "--gradient_accumulation_steps",
        accumulation,
        "--num_ppo_epochs",
        2,
        "--loss_type",
        "token",
        "--ppo_clip",
        "--loss_aggregation",
        "token-mean",  # divided by the tokens of the whole minibatch (its count: tokens_in_loss, over every process)
        "--local_rollout_forward_batch_size",
        16,
        "--max_completion_length",
        8,
        "--max_prompt_length",
        32,
        "--learning_rate",
        "3e-3",
        "--beta",
        0.1,
        "--entropy_coef",
        0.01,
        "--num_sample_generations",
        1,
        "--run_name",
        "run",
        "--seed",
        5,
        *extra,
    ]


# Defined per micro-batch: one process's micro-batch is not the two processes' micro-batches together
PER_MICRO_BATCH = {"val/ratio", "val/ratio_var", "clip_ratio/low_min", "clip_ratio/high_max"}
SPLIT = {"perf/micro_batches_per_step", "perf/micro_batch_tokens_max"}  # what the split is


def test_two_processes_compute_the_update_of_one_process_on_the_same_global_batch(tiny, prompts_file, tmp_path):
    from test_resume import weights_moved

    one, two, sharded = tmp_path / "one", tmp_path / "two", tmp_path / "sharded"
    one.mkdir(), two.mkdir(), sharded.mkdir()
    # The reference: one process, the minibatch in one micro-batch, where a token count of one micro-batch or of one
    # process would be the minibatch's; the 2-process runs split it in 2 x 2 micro-batches of 8 rows, or in those a
    # budget packs (7 or 8 of unequal sizes), where it would not
    proc = run_rloo(*same_batch_args(tiny, prompts_file, 32, accumulation=1), cwd=one, script="rloo_multigpu.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert weights_moved(run_outcome(str(one / "runs" / "run"))[2], tiny["policy"])  # it trained: else all agree
    proc = run_torchrun(2, *same_batch_args(tiny, prompts_file, 8), cwd=two)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # generating from the sharded policy (every forward gathers each layer) samples what the gathered policy samples
    proc = run_torchrun(2, *same_batch_args(tiny, prompts_file, 8, "--no_gather_for_generation"), cwd=sharded)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_outcome(str(sharded / "runs" / "run"))[:2] == run_outcome(str(two / "runs" / "run"))[:2]
    # FSDP2's CPU offload (weights, gradients and AdamW states in CPU memory between uses; on CPU its copies are no-ops,
    # but its code path runs): the same run
    offload = tmp_path / "offload"
    offload.mkdir()
    proc = run_torchrun(2, *same_batch_args(tiny, prompts_file, 8, "--fsdp_cpu_offload"), cwd=offload)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (m_off, s_off, w_off), (m_two, s_two, w_two) = (run_outcome(str(d / "runs" / "run")) for d in (offload, two))
    assert (m_off, s_off) == (m_two, s_two) and all(torch.equal(w_off[k], w_two[k]) for k in w_two)

    # micro-batches of at most 40 tokens (rows of up to 32 + 8): each process packs its own, as many as the other
    budget = tmp_path / "budget"
    budget.mkdir()
    proc = run_torchrun(2, *same_batch_args(tiny, prompts_file, 8, "--max_tokens_per_micro_batch", 40), cwd=budget)
    assert proc.returncode == 0, proc.stderr[-3000:]

    (m1, s1, w1), (m2, s2, w2) = run_outcome(str(one / "runs" / "run")), run_outcome(str(two / "runs" / "run"))
    m_budget, _, w_budget = run_outcome(str(budget / "runs" / "run"))
    assert s1 == s2  # the same greedy sample tables
    assert len(m1) == len(m2) == len(m_budget) == 2
    split = [(m["perf/micro_batch_tokens_max"], m["perf/micro_batches_per_step"]) for m in read_metrics(budget)]
    assert all(tokens <= 40 and count > 2 for tokens, count in split), split
    for a, b, c in zip(m1, m2, m_budget):
        assert a.keys() == b.keys() == c.keys()
        for k in a.keys() - PER_MICRO_BATCH - SPLIT:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
            assert c[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), ("budget", k)
    assert m1[-1]["kl"] != 0 and m1[0]["loss/policy_avg"] != 0  # it trained (k1: a KL of either sign)
    assert m1[0]["loss/entropy_bonus"] > 0  # 0.01 x entropies of a random policy: equal over the processes above
    # Adam magnifies rounding where a gradient is ~0 (m / sqrt(v) of two tiny numbers): such a weight may move by up to
    # the learning rate a step either way, and packing 16 rows or 8 + 8 (padding-free) rounds differently. A few in a
    # thousand may do so; a wrong update would move most.
    for k in w1:
        for w in (w2, w_budget):
            off = ~torch.isclose(w[k], w1[k], rtol=1e-3, atol=1e-4)
            assert off.float().mean() <= 1e-3 and (w[k] - w1[k]).abs().max() <= 4 * 3e-3, (k, int(off.sum()))


def test_bf16_mixed_precision_with_gradient_checkpointing_and_a_reward_model(tiny, prompts_file, tmp_path):
    """--bf16 is FSDP2's mixed precision, the reference sharded the same way: the KL is exactly 0 before the first
    update, and training goes on (reward model sharded too, activations recomputed)."""
    proc = run_torchrun(
        2,
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--bf16",
        "--gradient_checkpointing",
        "--reward_model_path",
        tiny["reward"],
        "--total_episodes",
        48,
        "--per_device_train_batch_size",
        8,
        "--max_completion_length",
        8,
        "--beta",
        0.1,
        "--learning_rate",
        3e-3,
        "--num_sample_generations",
        0,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert rows[0]["kl"] == 0 and rows[0]["objective/kl"] == 0
    assert rows[-1]["kl"] != 0 and all(math.isfinite(r["loss/policy_avg"]) for r in rows)


def worker_pids(torchrun_pid: int) -> dict[int, int]:
    """rank -> pid of the worker processes torchrun started."""
    ranks = {}
    for pid in subprocess.run(
        ["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True, timeout=600
    ).stdout.split():
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = int(pid)
    return ranks


def resume_args(tiny, data, *extra):
    """6 updates of 2 epochs x 2 minibatches with a KL and sample tables, a checkpoint every 3."""
    return [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        data,
        "--reward_funcs",
        f"{REWARDS}:slow_text_length",
        "--total_episodes",
        96,
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
        3,
        "--run_name",
        "run",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(tiny, prompts_file, tmp_path_factory):
    """The uninterrupted run of resume_args on 2 processes: its folder (checkpoints after updates 3 and 6) and
    outcome."""
    from test_resume import weights_moved

    cwd = tmp_path_factory.mktemp("reference")
    proc = run_torchrun(2, *resume_args(tiny, prompts_file), cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = run_outcome(str(cwd / "runs" / "run"))
    assert [r["episode"] for r in expected[0]] == [16 * i for i in range(1, 7)]
    assert weights_moved(expected[2], tiny["policy"]) and expected[0][-1]["kl"] != 0  # it trained (k1: either sign)
    return cwd, expected


def test_sigterm_on_one_process_or_sigkill_on_all_then_resume_is_the_same_run(reference, tiny, prompts_file, tmp_path):
    expected = reference[1]
    interrupted, killed = tmp_path / "interrupted", tmp_path / "killed"
    interrupted.mkdir(), killed.mkdir()

    # SIGKILL of every process after the checkpoint of update 3: the resumed run starts from it
    metrics = killed / "runs" / "run" / "metrics.jsonl"
    proc = subprocess.Popen(
        [*torchrun(2), *map(str, resume_args(tiny, prompts_file))],
        cwd=killed,
        env=run_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_updates(proc, metrics, 4)
    for pid in worker_pids(proc.pid).values():
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert sorted(os.listdir(killed / "runs" / "run" / "checkpoints"))[-1] == "checkpoint-3"
    resumed = run_torchrun(2, *resume_args(tiny, prompts_file, "--resume_from_checkpoint", "latest"), cwd=killed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = run_outcome(str(killed / "runs" / "run"))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert all(torch.equal(got[2][k], expected[2][k]) for k in expected[2])

    # SIGTERM to one process: every process finishes the update and writes its part of the checkpoint

    metrics = interrupted / "runs" / "run" / "metrics.jsonl"
    proc = subprocess.Popen(
        [*torchrun(2), *map(str, resume_args(tiny, prompts_file))],
        cwd=interrupted,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_updates(proc, metrics, 4)
    os.kill(worker_pids(proc.pid)[1], signal.SIGTERM)  # rank 1 only
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0
    checkpoints = sorted(os.listdir(interrupted / "runs" / "run" / "checkpoints"))
    assert checkpoints[-1] in ("checkpoint-4", "checkpoint-5"), (checkpoints, stderr[-3000:])
    command = stdout.split("Continue the run with:\n")[1].strip()
    assert command.startswith("torchrun --nproc_per_node 2 ") and "--resume_from_checkpoint" in command
    resumed = run_torchrun(2, *resume_args(tiny, prompts_file, "--resume_from_checkpoint", "latest"), cwd=interrupted)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    got = run_outcome(str(interrupted / "runs" / "run"))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert all(torch.equal(got[2][k], expected[2][k]) for k in expected[2])


def test_a_checkpoint_resumes_only_on_as_many_processes(reference, tiny, prompts_file, tmp_path):
    shutil.copytree(reference[0] / "runs", tmp_path / "runs")
    resumed = run_rloo(
        *resume_args(tiny, prompts_file, "--resume_from_checkpoint", "latest"), cwd=tmp_path, script="rloo_multigpu.py"
    )
    check_one_line_error(resumed, "written by 2 processes", "this run has 1")
    assert run_outcome(str(tmp_path / "runs" / "run"))[0] == reference[1][0]  # the run's folder as it was


@pytest.mark.parametrize(
    "func, needle, checkpoint",
    [
        (
            "fails_on_rank_1_at_call_4",
            "checkpoint-2",
            "checkpoint-2",
        ),  # update 3's rollout: update 2 is the last whole one
        ("fails_in_the_second_sample_table", "the state after update 3", "checkpoint-3"),  # the table after update 3
    ],
)
def test_a_reward_function_failing_on_one_process_stops_all_with_one_line_and_a_checkpoint(
    func, needle, checkpoint, tiny, prompts_file, tmp_path
):
    """It fails on rank 1 only: one error line from rank 0 naming rank 1, no gloo traceback, the last whole update."""
    proc = run_torchrun(
        2,
        *resume_args(tiny, prompts_file, "--reward_funcs", f"{REWARDS}:{func}", "--save_steps", 0),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode != 0
    (line,) = our_errors(proc.stderr)
    assert "the judge is down" in line and "(on rank 1)" in line and needle in line, line
    assert os.listdir(tmp_path / "runs" / "run" / "checkpoints") == [checkpoint]
    assert "gloo" not in proc.stderr


def test_a_reward_function_hanging_on_one_process_stops_all_at_its_timeout_with_a_checkpoint(
    tiny, prompts_file, tmp_path
):
    proc = run_torchrun(
        2,
        *resume_args(
            tiny,
            prompts_file,
            "--reward_funcs",
            f"{REWARDS}:hangs_on_rank_1_at_call_4",
            "--save_steps",
            0,
            "--reward_timeout",
            3,
        ),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode != 0
    (line,) = our_errors(proc.stderr)
    assert "hangs_on_rank_1_at_call_4 did not return within --reward_timeout 3 s (on rank 1)" in line, line
    assert "checkpoint-2" in line and os.listdir(tmp_path / "runs" / "run" / "checkpoints") == ["checkpoint-2"]


def test_a_process_that_dies_ends_the_job_without_a_hang(tiny, prompts_file, tmp_path):
    start = time.time()
    proc = run_torchrun(
        2,
        *resume_args(tiny, prompts_file, "--reward_funcs", f"{REWARDS}:exits_on_rank_1"),
        cwd=tmp_path,
        timeout=300,
        env={"RLOO_TEST_EXIT_CODE": "7"},
    )
    assert proc.returncode != 0
    assert time.time() - start < 200
    # rank 0 says why it stops in one line, without the collective's traceback (torchrun then reports the failure)
    (line,) = our_errors(proc.stderr)
    assert "another process stopped answering" in line and "(on rank 0)" in line, line


def test_launch_errors_are_one_line(tiny, prompts_file, tmp_path):
    # the completions of a prompt must stay on one process
    proc = run_torchrun(
        2,
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--per_device_train_batch_size",
        2,
        "--num_generations",
        4,
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    (line,) = our_errors(proc.stderr)
    assert "of each process" in line and "--num_generations 4" in line, line
    assert not os.path.exists(tmp_path / "runs")
    # a --generation_kwargs value HF generate cannot take (it was a traceback per process, after the model loaded)
    proc = run_torchrun(
        2,
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--generation_kwargs",
        '{"typical_p": "abc"}',
        cwd=tmp_path,
    )
    (line,) = our_errors(proc.stderr)
    assert "HF generate cannot use it (TypeError" in line, line  # (torchrun's own report of the exit follows)
    # a rendezvous variable missing
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--model_name_or_path", tiny["policy"]],
        cwd=tmp_path,
        env={**run_env(), "RANK": "0", "WORLD_SIZE": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    check_one_line_error(proc, "LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not", "torchrun")
    # a timeout the process group cannot take (it was a C++ stack blaming another process)
    for timeout in (0, -5):
        proc = subprocess.run(
            [sys.executable, SCRIPT, "--model_name_or_path", tiny["policy"], "--ddp_timeout", str(timeout)],
            cwd=tmp_path,
            env=run_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        check_one_line_error(proc, f"--ddp_timeout must be > 0 seconds, got {timeout}")
    # a vLLM server that is not there
    proc = run_torchrun(
        2,
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--vllm_server_host",
        "127.0.0.1",
        "--vllm_server_port",
        free_port(),
        cwd=tmp_path,
    )
    (line,) = our_errors(proc.stderr)
    assert "does not answer /v1/models" in line and "start the server first" in line, line
    assert not os.path.exists(tmp_path / "runs")


def test_a_parse_error_is_said_once_not_once_per_process(tmp_path):
    """The options are parsed before the process group, each process alike: rank 0 alone says why (torchrun's RANK;
    unset, a plain `python`), and every process exits 2. Then under torchrun itself: one line for the two."""
    from rloo_utils.options import PARSE_ERROR_WAIT

    for rank in ("0", "1"):
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, SCRIPT, "--no_such_option"],
            cwd=tmp_path,
            capture_output=True,
            env={**run_env(), "RANK": rank, "WORLD_SIZE": "2"},
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr[-3000:]
        if rank == "0":
            line = check_one_line_error(proc, "Unrecognized options: --no_such_option", "--help` lists them")
            assert proc.stderr.strip() == line
        else:  # silent, and it waits: torchrun would stop rank 0 before it says why, were rank 1 first to exit
            assert proc.stderr == "" and proc.stdout == ""
            assert time.monotonic() - start >= PARSE_ERROR_WAIT
    proc = run_torchrun(2, "--no_such_option", cwd=tmp_path)
    assert proc.returncode != 0
    (line,) = our_errors(proc.stderr)
    assert "Unrecognized options: --no_such_option" in line, line


def test_the_tldr_seed_command_runs_on_several_processes_as_documented(tiny, tmp_path):
    """docs/multigpu.md's torchrun block: its batches on the 8 processes documented, as the script computes them; then
    the block itself, hub ids swapped for the test model and local data, the batch made small, on 2 processes instead of
    8, to its first update."""
    readme = open(os.path.join(ROOT, "docs", "multigpu.md")).read()
    block = re.search(r"<!-- seed command: tldr multigpu -->\n```bash\n(.*?)```", readme, re.S).group(1)
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:4] == ["torchrun", "--nproc_per_node", "8", "rloo_multigpu.py"]
    from test_end_to_end import SMALL_BATCH, documented_batches

    # on the 8 processes documented: 2 minibatches of 16 x 16 accumulated on each process
    assert documented_batches(argv[4:], "rloo_multigpu", world_size=8) == (16 * 16 * 8 * 2, 16 * 16 * 8, 244)
    posts = [
        {"prompt": f"SUBREDDIT: r/movies\n\nTITLE: {w}\n\nPOST: the film was {w}\n\nTL;DR:"}
        for w in ["good", "bad"] * 8
    ]
    data = os.path.dirname(write_jsonl(str(tmp_path / "tldr" / "train.jsonl"), posts * 80))
    write_jsonl(str(tmp_path / "tldr" / "validation.jsonl"), posts)
    local = {
        "trl-internal-testing/tldr-preference-sft-trl-style": data,
        "EleutherAI/pythia-1b-deduped": tiny["policy"],
        "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr": tiny["policy"],
        "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr": tiny["reward"],
    }
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(
            [
                *torchrun(2),
                *(local.get(a, a) for a in argv[4:]),
                *SMALL_BATCH,
                "--local_rollout_forward_batch_size",
                "8",
            ],
            cwd=tmp_path,
            env=run_env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            metrics, deadline = tmp_path / "runs", time.time() + 600
            while time.time() < deadline and proc.poll() is None:
                found = list(metrics.glob("*/metrics.jsonl"))
                updates = []  # (an evaluation of the validation split comes before the first update)
                if found and found[0].read_text().endswith("\n"):
                    updates = [row for row in map(json.loads, found[0].read_text().splitlines()) if "episode" in row]
                if updates:
                    row = updates[0]
                    break
                time.sleep(0.5)
            else:
                raise AssertionError(
                    f"no update logged (exit {proc.returncode}): {(tmp_path / 'stderr.txt').read_text()[-3000:]}"
                )
        finally:  # torchrun's workers are not in its process group: they are killed one by one
            for pid in worker_pids(proc.pid).values():
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait(timeout=60)
    assert row["episode"] == 8 * 2 * 2 and row["completions/max_length"] <= 53  # 2 minibatches of 8 on 2 processes
    assert "kl" in row and row["val/ratio_var"] >= 0


# Last in this file: the server (module-scoped) keeps a core busy from its first use to the end of the module
def test_two_processes_sample_from_the_server_at_another_temperature(tiny, server, prompts_file, tmp_path):
    """The start-up check compares greedy log-probs at temperature 1 (vLLM's for greedy), whatever --temperature; the
    samples' log-probs are the trainer's at --temperature."""
    proc = run_torchrun(
        2,
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--reward_funcs",
        f"{REWARDS}:count_good",
        "--total_episodes",
        64,
        "--per_device_train_batch_size",
        16,
        "--max_completion_length",
        8,
        "--temperature",
        0.5,
        "--num_sample_generations",
        0,
        "--vllm_server_base_url",
        server["url"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert len(rows) == 2 and all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in rows), rows


@pytest.mark.learning
def test_two_processes_sampling_from_the_vllm_server_raise_a_simple_reward(
    tiny, server, prompts_file, tmp_path, learning_seed, request
):
    """Only happens if the gathered weights reach the server after every update: the samples come from vLLM."""
    task = learning_task(tiny["policy"], prompts_file, learning_seed, per_device_train_batch_size=16)
    proc = run_torchrun(2, *task, "--vllm_server_base_url", server["url"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    # a server left on the initial weights would stay near the first updates' reward
    check_learned(request, [r["reward"] for r in rows], gain=1.0)
    # the server sampled from the policy being trained: its log-probs are the trainer's, update after update
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in rows)
    assert all(abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3 for r in rows)
    assert all(r["time/weight_sync"] > 0 for r in rows)
    # vLLM reads the saved model's weights: the server, reloaded from it (after the initial model), gives the saved
    # model's log-probs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (run,) = os.listdir(tmp_path / "runs")
    saved = str(tmp_path / "runs" / run / "model")
    tokenizer, model = AutoTokenizer.from_pretrained(saved), AutoModelForCausalLM.from_pretrained(saved)
    ids = tokenizer("the movie was").input_ids

    def post(route, body):
        request = urllib.request.Request(
            server["url"] + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        return json.load(urllib.request.urlopen(request, timeout=120))

    def greedy_after_reloading(folder):
        post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}})
        post("/reset_prefix_cache", {})
        choice = post(
            "/v1/completions",
            {
                "model": tiny["policy"],
                "prompt": ids,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                "logprobs": 0,
            },
        )["choices"][0]
        return choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"])

    def saved_model_logprobs(completion):
        with torch.no_grad():
            logits = model(torch.tensor([ids + completion])).logits[0, len(ids) - 1 : -1]
        return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]

    completion, logprobs = greedy_after_reloading(tiny["policy"])
    assert (logprobs - saved_model_logprobs(completion)).abs().max() > 1e-2  # the initial model is another model
    completion, logprobs = greedy_after_reloading(saved)
    torch.testing.assert_close(logprobs, saved_model_logprobs(completion), atol=1e-4, rtol=0)


def test_two_processes_push_the_merged_lora_policy_to_the_server(tiny, server, prompts_file, tmp_path):
    """The LoRA policy's shards gathered and merged one weight at a time: the server samples from the trained policy."""
    proc = run_torchrun(
        2,
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--reward_funcs",
        f"{REWARDS}:text_length",
        "--total_episodes",
        96,
        "--per_device_train_batch_size",
        16,
        "--max_completion_length",
        8,
        "--learning_rate",
        "3e-3",
        "--num_sample_generations",
        0,
        "--use_peft",
        "--lora_target_modules",
        "all-linear",
        "--vllm_server_base_url",
        server["url"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert len(rows) == 3 and all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in rows), rows
    assert rows[-1]["kl"] != 0  # the adapter moved the policy away from its reference, the base
