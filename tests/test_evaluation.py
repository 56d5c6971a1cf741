"""The held-out evaluation: its estimators against hand-computed values and brute force, its schedule and checks, and
the runs: a run that evaluates trains exactly as one that does not (rloo.py, rloo_vllm.py), a resumed run evaluates
and trains as the uninterrupted one, and 2 processes of rloo_multigpu.py evaluate as 1 does.
"""

import itertools
import json
import math
import os
import random
import signal
import statistics

import numpy as np
import pytest
import torch

from conftest import WORDS, check_one_line_error, run_outcome, run_rloo, write_jsonl
from test_multigpu import run_torchrun
from test_resume import REWARDS, assert_same_run, checkpoint_names, start, train_args, wait_until, weights_moved

import rloo
from rloo_utils.errors import UsageError
from rloo_utils.evaluation import (
    best_at_k,
    check_evaluation_names,
    check_metric_values,
    evaluation_updates,
    joined_metric_values,
    own_random_streams,
    pass_at_k,
    per_source_metrics,
    sample_counts,
    task_metrics,
)
from rloo_utils.checks import check_args


# ---- The estimators --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (4, 1, 1, 1 / 4),
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (4, 1, 4, 1.0),
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (8, 0, 8, 0.0),
        (8, 8, 1, 1.0),
    ],
)
def test_pass_at_k_is_chen_et_al_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_and_best_at_k_are_the_means_over_every_draw_of_k(n):
    """Brute force: the mean, over every set of k of the n completions, of whether one succeeds (of the largest)."""
    rng = random.Random(n)
    values = [rng.choice([0.0, 1.0]) for _ in range(n)]
    rewards = [rng.uniform(-1, 1) for _ in range(n)]
    for k in range(1, n + 1):
        draws = list(itertools.combinations(range(n), k))
        assert pass_at_k(n, int(sum(values)), k) == pytest.approx(
            statistics.mean(max(values[i] for i in d) for d in draws)
        )
        assert best_at_k(values, k) == pytest.approx(pass_at_k(n, int(sum(values)), k))
        assert best_at_k(rewards, k) == pytest.approx(statistics.mean(max(rewards[i] for i in d) for d in draws))
    assert best_at_k([1.0, 2.0, 3.0, 4.0], 2) == pytest.approx(20 / 6)  # pairs' maxima: 2 3 4 3 4 4


def test_sample_counts():
    assert sample_counts(1) == [1]
    assert sample_counts(4) == [1, 2, 4]
    assert sample_counts(6) == [1, 2, 4, 6]


def test_task_metrics_by_hand():
    # 2 prompts x 4 completions; the second prompt's last completion was not scored (a reward function's None)
    rewards = torch.tensor([[0.0, 1.0, 0.5, 0.2], [2.0, 0.0, 1.0, math.nan]])
    solved = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    length = torch.tensor([[3.0, 5.0, 4.0, 4.0], [1.0, 1.0, 1.0, 1.0]])
    metrics = task_metrics(rewards, {"solved": (solved, True), "length": (length, False)}, success_threshold=1.0)
    assert metrics["mean@4"] == pytest.approx((1.7 / 4 + 3.0 / 3) / 2)
    assert metrics["best@1"] == pytest.approx(metrics["mean@4"])
    assert metrics["best@4"] == pytest.approx((1.0 + 2.0) / 2)  # the second prompt: its 3 scored values
    # reward >= 1: 1 of 4 for the first prompt, 2 of 3 for the second
    assert metrics["pass@1"] == pytest.approx((1 / 4 + 2 / 3) / 2)
    assert metrics["pass@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert metrics["solved/mean@4"] == pytest.approx(1 / 8)
    assert metrics["solved/pass@2"] == pytest.approx(0.5 / 2)
    assert metrics["solved/pass@4"] == pytest.approx(0.5)
    assert metrics["length/mean@4"] == pytest.approx(2.5) and metrics["length/best@4"] == pytest.approx(3.0)
    assert "pass@1" not in task_metrics(rewards, {}, success_threshold=None)
    assert "solved/best@2" not in metrics and "length/pass@2" not in metrics

    by_source = per_source_metrics(rewards, {"solved": (solved, True)}, 1.0, ["gsm8k", "math"])
    assert by_source["gsm8k/reward"] == pytest.approx(1.7 / 4) and by_source["math/reward"] == pytest.approx(1.0)
    assert by_source["gsm8k/solved/pass@4"] == 1.0 and by_source["math/solved/pass@4"] == 0.0
    assert by_source["math/pass@1"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    "eval_steps,on_start,num_updates,expected",
    [
        (0.5, True, 40, {0, 20, 40}),  # the embedded default: start, middle, end
        (0.5, False, 40, {20, 40}),
        (0.3, True, 10, {0, 3, 6, 9, 10}),  # a fraction rounds up, as TRL's eval_steps
        (3, True, 10, {0, 3, 6, 9, 10}),
        (20, False, 10, {10}),  # always after the last update
        (0, True, 10, set()),
    ],
)
def test_when_a_run_evaluates(eval_steps, on_start, num_updates, expected):
    assert evaluation_updates(eval_steps, on_start, num_updates) == expected


def test_metric_values_booleans_numbers_and_none():
    values, boolean = check_metric_values([True, None, False], "solved", 3)
    assert boolean is True and values[0] == 1.0 and math.isnan(values[1]) and values[2] == 0.0
    values, boolean = check_metric_values([0.5, None, 2], "length", 3)
    assert boolean is False and values.tolist()[2] == 2.0
    assert check_metric_values([None, None], "nothing", 2)[1] is None
    assert check_metric_values(torch.tensor([True, False]), "as_tensor", 2)[1] is True
    assert check_metric_values(np.array([0.5, 1.0]), "as_array", 2)[1] is False
    with pytest.raises(UsageError, match="evaluation metric function mixed returned both booleans and numbers"):
        check_metric_values([True, 0.5], "mixed", 2)
    with pytest.raises(UsageError, match="evaluation metric function bad must return a list of 2 floats"):
        check_metric_values([1.0], "bad", 2)
    chunks = [[(torch.tensor([1.0, 0.0]), True)], [(torch.tensor([math.nan, math.nan]), None)]]
    joined = joined_metric_values(chunks, ["solved"], 2)
    assert joined["solved"][1] is True and joined["solved"][0].shape == (2, 2)
    with pytest.raises(UsageError, match="returned booleans for some test prompts and numbers for others"):
        joined_metric_values([[(torch.tensor([1.0]), True)], [(torch.tensor([0.5]), False)]], ["solved"], 1)


def test_a_name_is_one_metrics():
    check_evaluation_names(["solved"], ["gsm8k", "math"])
    with pytest.raises(
        UsageError, match="data source \\(column data_source\\) 'reward' would be logged as eval/reward"
    ):
        check_evaluation_names([], ["reward"])
    with pytest.raises(UsageError, match="'solved' would be logged as eval/solved/..., a name that the evaluation"):
        check_evaluation_names(["solved"], ["solved"])


def test_own_random_streams_leave_the_training_streams_as_they_were():
    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    expected = draws()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    with own_random_streams(1, 5, torch.device("cpu")):
        inside = draws()
    assert draws() == expected
    with own_random_streams(1, 5, torch.device("cpu")):
        assert draws() == inside  # the evaluation after an update draws the same wherever the run stands
    with own_random_streams(1, 6, torch.device("cpu")):
        assert draws() != inside


@pytest.mark.parametrize(
    "options,needle",
    [
        ({"eval_steps": 1.5}, "--eval_steps must be a whole number of updates, a fraction of the run below 1"),
        ({"eval_steps": -1}, "--eval_steps must be a whole number"),
        ({"max_eval_prompts": 0}, "--max_eval_prompts must be at least 1"),
        ({"num_generations_eval": 0}, "--num_generations_eval must be at least 1"),
        ({"eval_temperature": -0.5}, "--eval_temperature must be >= 0"),
        (
            {"eval_temperature": 0},
            "the 4 completions of a test prompt would all be the same: add --num_generations_eval 1",
        ),
    ],
)
def test_evaluation_options_that_make_no_sense(options, needle):
    with pytest.raises(UsageError, match=__import__("re").escape(needle)):
        check_args(rloo.Args(**options))
    check_args(rloo.Args(eval_temperature=0, num_generations_eval=1))


# ---- The runs --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def split_data(tmp_path_factory):
    """A folder of two splits: train.jsonl, and test.jsonl with a data_source column."""
    folder = tmp_path_factory.mktemp("splits") / "data"
    rng = random.Random(3)

    def rows(n, **columns):
        return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))), **columns} for _ in range(n)]

    write_jsonl(str(folder / "train.jsonl"), rows(24))
    write_jsonl(str(folder / "test.jsonl"), [{**r, "data_source": ["a", "b"][i % 2]} for i, r in enumerate(rows(5))])
    return str(folder)


EVAL = ["--eval_steps", 2, "--eval_success_threshold", 0.5, "--eval_metric_funcs", f"{REWARDS}:says_good"]


def evaluations(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "eval/reward" in row]


def training(outcome):
    """A run's outcome (run_outcome) without its evaluations."""
    return [row for row in outcome[0] if "episode" in row], outcome[1], outcome[2]


@pytest.fixture(scope="module")
def evaluated(tiny, split_data, tmp_path_factory):
    """train_args' run of 6 updates (a KL penalty, 2 epochs of 2 minibatches, sample tables) evaluating after updates
    0, 2, 4 and 6; never interrupted."""
    cwd = tmp_path_factory.mktemp("evaluated")
    proc = run_rloo(*train_args(tiny, split_data, *EVAL), cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd, run_outcome(os.path.join(cwd, "runs", "run"))


@pytest.mark.slow
def test_an_evaluation_logs_its_task_metrics(evaluated, tiny):
    cwd, outcome = evaluated
    rows = evaluations(os.path.join(cwd, "runs", "run"))
    assert [r["step"] for r in rows] == [0, 16, 32, 48]  # after updates 0, 2, 4, 6 of 8 completions
    for row in rows:
        assert row["eval/prompts"] == 5 and row["eval/seconds"] > 0
        assert row["eval/mean@4"] == pytest.approx(row["eval/reward"])  # every completion scored
        assert row["eval/best@1"] == pytest.approx(row["eval/mean@4"]) and row["eval/best@4"] >= row["eval/best@2"]
        assert 0 <= row["eval/pass@1"] <= row["eval/pass@2"] <= row["eval/pass@4"] <= 1
        assert 0 <= row["eval/says_good/pass@1"] <= row["eval/says_good/pass@4"] <= 1
        assert row["eval/says_good/mean@4"] == pytest.approx(row["eval/says_good/pass@1"])
        # 3 prompts of source a (rows 0, 2, 4) and 2 of b: the overall mean is their prompt-weighted mean
        assert row["eval/mean@4"] == pytest.approx((3 * row["eval/a/mean@4"] + 2 * row["eval/b/mean@4"]) / 5)
        assert row["eval/completions/mean_length"] > 0 and "eval/rewards/slow_text_length/mean" in row
    assert weights_moved(outcome[2], tiny["policy"])  # it trained between the evaluations
    assert training(outcome)[0][-1]["kl"] != 0  # the policy evaluated last is not its reference (k1: of either sign)


@pytest.mark.slow
def test_a_run_trains_exactly_as_it_would_without_evaluating(evaluated, tiny, split_data, tmp_path):
    proc = run_rloo(*train_args(tiny, split_data, "--eval_steps", 0), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no held-out evaluation (--eval_steps 0)" in " ".join(proc.stdout.split())
    without = run_outcome(os.path.join(tmp_path, "runs", "run"))
    assert not evaluations(os.path.join(tmp_path, "runs", "run"))
    assert_same_run(training(without), training(evaluated[1]))


@pytest.mark.slow
def test_a_resumed_run_evaluates_and_trains_as_the_uninterrupted_one(evaluated, tiny, split_data, tmp_path):
    def updates_logged():
        path = tmp_path / "runs" / "run" / "metrics.jsonl"
        return sum('"episode"' in line for line in open(path)) if path.exists() else 0

    proc = start(tmp_path, *train_args(tiny, split_data, *EVAL))
    wait_until(lambda: updates_logged() >= 4, proc)  # past checkpoint-3 and the evaluation after update 2
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL and checkpoint_names(tmp_path) == ["checkpoint-3"]
    resumed = run_rloo(*train_args(tiny, split_data, *EVAL, "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(evaluated[1], run_outcome(os.path.join(tmp_path, "runs", "run")))  # evaluations included


@pytest.mark.slow
def test_a_single_file_has_no_held_out_split(tiny, prompts_file, tmp_path):
    proc = run_rloo(*train_args(tiny, prompts_file), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"no held-out evaluation: dataset {prompts_file} has no split 'test'" in " ".join(proc.stdout.split())
    (tmp_path / "again").mkdir()
    check_one_line_error(
        run_rloo(
            *train_args(tiny, prompts_file, "--eval_metric_funcs", f"{REWARDS}:says_good"), cwd=tmp_path / "again"
        ),
        "--eval_metric_funcs is for the held-out evaluation, but dataset",
        "has no split 'test' (--dataset_test_split; a single file is one split)",
    )


@pytest.mark.slow
def test_a_broken_metric_function_is_one_line_before_training(tiny, split_data, tmp_path):
    check_one_line_error(
        run_rloo(*train_args(tiny, split_data, "--eval_metric_funcs", f"{REWARDS}:nope"), cwd=tmp_path),
        f"{REWARDS} has no function 'nope' (from --eval_metric_funcs {REWARDS}:nope)",
    )
    assert not os.path.exists(tmp_path / "runs")  # refused before the run claimed a folder


@pytest.mark.slow
def test_rloo_vllm_trains_exactly_as_it_would_without_evaluating(tiny, split_data, tmp_path):
    args = train_args(tiny, split_data)
    outcomes = []
    for name, extra in [("with", EVAL), ("without", ["--eval_steps", 0])]:
        (tmp_path / name).mkdir()
        proc = run_rloo(*args, *extra, cwd=tmp_path / name, script="rloo_vllm.py")
        assert proc.returncode == 0, proc.stderr[-3000:]
        outcomes.append(run_outcome(os.path.join(tmp_path, name, "runs", "run")))
    assert len(evaluations(os.path.join(tmp_path, "with", "runs", "run"))) == 4
    assert_same_run(training(outcomes[1]), training(outcomes[0]))


@pytest.mark.slow
def test_two_processes_evaluate_as_one(tiny, split_data, tmp_path):
    """Each process evaluates its share of the prompts (3 and 2 of 5: the second repeats one, dropped), each completion
    from its own seed (one prompt per generation chunk): the metrics are those of one process evaluating all."""
    args = [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        split_data,
        "--reward_funcs",
        f"{REWARDS}:count_good",
        "--total_episodes",
        32,
        "--max_completion_length",
        8,
        "--num_sample_generations",
        0,
        "--local_rollout_forward_batch_size",
        4,
        "--run_name",
        "run",
        *EVAL,
    ]
    rows = {}
    for nproc in (1, 2):
        (tmp_path / str(nproc)).mkdir()
        per_process = ["--per_device_train_batch_size", 16 // nproc]
        proc = run_torchrun(nproc, *args, *per_process, cwd=tmp_path / str(nproc))
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[nproc] = [
            {k: v for k, v in r.items() if k != "eval/seconds"}
            for r in evaluations(tmp_path / str(nproc) / "runs" / "run")
        ]
    assert [r["step"] for r in rows[1]] == [0, 32]
    assert rows[2] == rows[1]


def test_a_shared_prompt_forward_generates_what_one_forward_per_row_does(tiny):
    """The evaluation's n completions of a prompt share its forward (shared_prompt_cache): greedy completions of
    left-padded prompts of different lengths are those of a forward per row, token for token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from rloo_utils.data import left_pad
    from rloo_utils.generation import shared_prompt_cache

    model = AutoModelForCausalLM.from_pretrained(tiny["policy"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny["policy"])
    texts = ["the movie was", "a really long and boring plot with a sad ending", "good"]
    ids, mask = left_pad([tokenizer(t)["input_ids"] for t in texts for _ in range(3)], tokenizer.pad_token_id)
    config = GenerationConfig(
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    cache = shared_prompt_cache(model, ids, mask, 3, config)
    assert cache is not None and cache.get_seq_length() == ids.shape[1] - 1
    with torch.no_grad():
        shared = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, generation_config=config)
        alone = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(shared.sequences, alone.sequences)
    for step_shared, step_alone in zip(shared.logits, alone.logits):  # each step's logits, to float rounding
        torch.testing.assert_close(step_shared, step_alone, rtol=1e-5, atol=1e-5)
    assert shared_prompt_cache(model, ids[:4], mask[:4], 3, config) is None  # not whole groups: nothing shared
