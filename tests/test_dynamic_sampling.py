"""--dynamic_sampling (DAPO): which groups are dropped, how many prompts each round samples and where they come from,
the rollout the rounds make, the seeds each round gives vLLM, the metrics, the refusal; end to end in rloo.py (with
evaluation, sample tables and a resume after a SIGKILL), rloo_vllm.py (colocated, and on a server with --max_staleness)
and rloo_multigpu.py on two processes, each update's logged completions read against its metrics. The multi-turn run
is in tests/test_tools.py."""

import json
import os
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import rloo
from rloo_utils import data
from rloo_utils.errors import UsageError
from rloo_utils.checks import check_args
from rloo_utils.rewards import task_scores
from rloo_utils.scoring import RewardLogs
from rloo_utils.rollouts import DynamicSampling, Rollout, rows_of_rollouts, varied_groups
from rloo_utils.tools import MultiTurn
from rloo_utils.vllm_sampling import sampling_seeds
from conftest import ROOT, read_metrics, run_env, run_outcome, run_rloo, run_rloo_vllm_in_process, wait_for_updates
from test_multigpu import run_torchrun
from test_vllm import REWARDS

G = 4


def test_a_group_is_kept_when_two_of_its_scored_completions_differ():
    nan = float("nan")
    scores = torch.tensor(
        [[1, 1, 1, 1], [0, 0, 0, 1], [nan, 2, 2, nan], [nan, nan, nan, 3], [nan, 1, 0, nan], [0.5, 0.5, 0.5, 0.5]]
    ).view(-1)
    assert varied_groups(scores, G).tolist() == [False, True, False, False, True, False]


def test_the_score_is_the_weighted_sum_less_the_eos_penalty():
    rewards = torch.tensor([[1.0, 2.0], [float("nan"), 4.0], [float("nan"), float("nan")]])
    ended = torch.tensor([True, False, False])
    weights = torch.tensor([1.0, 0.5])
    got = task_scores(rewards, weights, ended, 1.5)
    assert got[:2].tolist() == [2.0, 0.5] and got[2].isnan()
    assert task_scores(rewards, weights, ended, None)[:2].tolist() == [2.0, 2.0]


def rollout_of(prompt_width: int, rows: int, first_id: int, turns=None) -> Rollout:
    """A rollout whose row i has prompt ids [first_id + i] left-padded to prompt_width, completion [first_id + i, 1]."""
    prompt_ids = torch.zeros(rows, prompt_width, dtype=torch.long)
    prompt_ids[:, -1] = torch.arange(first_id, first_id + rows)
    prompt_mask = (prompt_ids != 0).long()
    completion_ids = torch.stack([torch.arange(first_id, first_id + rows), torch.ones(rows, dtype=torch.long)], 1)
    return Rollout(
        prompts=[f"p{first_id + i}" for i in range(rows)],
        columns={"answer": [first_id + i for i in range(rows)]},
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=torch.ones_like(completion_ids),
        tool_mask=torch.zeros_like(completion_ids),
        ended=torch.tensor([i % 2 == 0 for i in range(rows)]),
        num_truncated=1,
        turns=turns,
        sampling_logprobs=-torch.ones(rows, 2) * first_id,
    )


def multi_turn(rows: int, first_id: int, calls: int) -> MultiTurn:
    per_row = [[first_id + i] for i in range(rows)]
    return MultiTurn(
        prompts=per_row, environments=per_row, schemas=per_row, tools=per_row, ids=per_row, tool_mask=per_row,
        sampler_logprobs=per_row, messages=per_row, ended=[True] * rows, calls=calls, failures=1, completions=rows,
        width=2,
    )  # fmt: skip


def test_the_rows_of_several_rollouts_make_one_with_every_row_as_it_was():
    a = rollout_of(prompt_width=2, rows=4, first_id=10, turns=multi_turn(4, 10, calls=3))
    b = rollout_of(prompt_width=5, rows=4, first_id=20, turns=multi_turn(4, 20, calls=2))
    got = rows_of_rollouts([(a, [2, 3]), (b, [0, 1, 3])], pad_token_id=0)
    taken = [12, 13, 20, 21, 23]
    assert got.prompts == [f"p{i}" for i in taken] and got.columns == {"answer": taken}
    assert got.prompt_ids.shape == (5, 5) and got.prompt_ids[:, -1].tolist() == taken  # left-padded to the widest
    assert got.prompt_mask.sum(1).tolist() == [1] * 5
    assert got.completion_ids[:, 0].tolist() == taken and got.ended.tolist() == [True, False, True, False, False]
    assert got.sampling_logprobs[:, 0].tolist() == [-10, -10, -20, -20, -20] and got.num_truncated == 2
    assert got.turns.ids == [[i] for i in taken] and got.turns.environments == [[i] for i in taken]
    # the tools' counts stay those of every row sampled, and so do the rows they are over
    assert (got.turns.calls, got.turns.failures, got.turns.completions) == (5, 2, 8)


class ScriptedSampler:
    """Each call to sample() answers the next round's prompts with completions whose first id is the prompt's `answer`
    column (so the scripted scorer can find them); records what each round asked for."""

    def __init__(self):
        self.tokenizer = SimpleNamespace(pad_token_id=0)
        self.configs = (None, None, None)  # sampling, greedy, the evaluation's
        self.asked = []

    def seeds_for(self, update, round_, num_rows):
        return [1000 * round_ + row for row in range(num_rows)]

    def sample(self, prompts, columns, config, seeds):
        self.asked.append((list(prompts), seeds))
        rows = len(prompts)
        rollout = rollout_of(prompt_width=3, rows=rows, first_id=1)
        rollout.prompts, rollout.columns = list(prompts), columns
        rollout.completion_ids[:, 0] = torch.tensor(columns["answer"])
        return rollout


class ScriptedScorer:
    """Scores a group of prompt p by the p-th entry of `varied`: True -> scores 0, 1, 0, 1; False -> all 1. Logs one
    extra column, the row's prompt, as a reward function's log_extra would."""

    def __init__(self, varied: dict):
        self.varied, self.weights, self.logs = varied, torch.tensor([1.0]), RewardLogs()

    def score(self, rollout):
        answers = rollout.completion_ids[:, 0].tolist()
        values = [float(i % 2) if self.varied[a] else 1.0 for i, a in enumerate(answers)]
        self.logs.log_extra("prompt_seen", list(rollout.prompts))
        return torch.tensor(values)[:, None], [f"text {a}" for a in answers]


def refill_of(sampler, scorer, dataset, max_rounds: int):
    return DynamicSampling(sampler, scorer, dataset, num_generations=G, max_rounds=max_rounds, seed=5, penalty=None)


def dataset_of(n: int):
    import datasets

    return datasets.Dataset.from_dict({"prompt": [f"q{i}" for i in range(n)], "answer": list(range(100, 100 + n))})


def first_round(sampler, scorer, answers: list[int]):
    prompts = [f"first{a}" for a in answers for _ in range(G)]
    rollout = sampler.sample(prompts, {"answer": [a for a in answers for _ in range(G)]}, None, None)
    sampler.asked.clear()
    rewards, texts = scorer.score(rollout)
    return rollout, rewards, rewards[:, 0], texts  # one reward source of weight 1: the scores are its rewards


def test_dropped_groups_are_replaced_by_as_many_new_prompts_a_round_until_the_batch_is_full():
    dataset = dataset_of(12)
    # the first round: prompts 1 and 3 vary, 2 and 4 do not; every resampled prompt of the dataset varies but 100-103
    varied = {1: True, 2: False, 3: True, 4: False, **{100 + i: i >= 4 for i in range(12)}}
    sampler, scorer = ScriptedSampler(), ScriptedScorer(varied)
    first, rewards, scores, texts = first_round(sampler, scorer, [1, 2, 3, 4])
    timer = rloo.logs.StageTimer()
    refill = refill_of(sampler, scorer, dataset, max_rounds=10)
    rollout, rewards, scores, texts, metrics = refill.refill(first, rewards, scores, texts, update=3, timer=timer)

    # each round asks for as many prompts as groups are missing, drawn by (seed, update, round), seeded by round
    drawn = [
        data.resampled_prompts(dataset, len(a) // G, 5, 3, r + 1)["answer"] for r, (a, _) in enumerate(sampler.asked)
    ]
    assert [len(a) // G for a, _ in sampler.asked][0] == 2
    for (asked, seeds), answers, round_ in zip(sampler.asked, drawn, range(1, 11)):
        assert asked == [f"q{a - 100}" for a in answers for _ in range(G)]
        assert seeds == [1000 * round_ + row for row in range(len(asked))]
    kept_answers = [1, 3] + [a for answers in drawn for a in answers if varied[a]][:2]
    assert rollout.completion_ids[::G, 0].tolist() == kept_answers and len(rollout.prompts) == 4 * G
    assert rewards[:, 0].view(-1, G).tolist() == [[0.0, 1.0, 0.0, 1.0]] * 4
    assert scores.view(-1, G).tolist() == [[0.0, 1.0, 0.0, 1.0]] * 4  # the kept rows' scores, resampled ones included
    assert texts[::G] == [f"text {a}" for a in kept_answers]
    assert scorer.logs.take(len(rollout.prompts))[0]["prompt_seen"] == rollout.prompts  # the kept rows' columns
    sampled = 4 + sum(len(a) // G for a, _ in sampler.asked)
    assert metrics["sampling/rounds"] == 1 + len(sampler.asked)
    assert metrics["sampling/groups_sampled"] == sampled
    assert metrics["sampling/groups_zero_std"] == 2 + sum(not varied[a] for answers in drawn for a in answers)
    assert metrics["sampling/frac_groups_zero_std"] == metrics["sampling/groups_zero_std"] / sampled
    assert (metrics["sampling/groups_kept"], metrics["sampling/groups_short"]) == (4, 0)
    assert metrics["sampling/generated_tokens"] == 2 * G * sampled  # 2 tokens per completion, every round's
    assert metrics["sampling/discarded_tokens"] == 2 * G * (sampled - 4)
    assert timer.seconds["resampling"] > 0 and timer.seconds["generation"] >= timer.seconds["resampling"]


def test_when_the_rounds_run_out_the_last_dropped_groups_fill_the_batch():
    varied = {1: True, 2: False, 3: False, 4: False, **{100 + i: False for i in range(12)}}
    sampler, scorer = ScriptedSampler(), ScriptedScorer(varied)
    first, rewards, scores, texts = first_round(sampler, scorer, [1, 2, 3, 4])
    refill = refill_of(sampler, scorer, dataset_of(12), max_rounds=2)
    rollout, _, scores, _, metrics = refill.refill(first, rewards, scores, texts, 1, rloo.logs.StageTimer())
    ((second_round, _),) = sampler.asked  # one more round: 3 prompts, none of them varied
    second = [int(p[1:]) + 100 for p in second_round[::G]]
    assert len(second) == 3
    # prompt 1 kept; then the three places the rounds left: the last three dropped groups, in the order sampled
    assert rollout.completion_ids[::G, 0].tolist() == [1] + second
    assert (metrics["sampling/groups_kept"], metrics["sampling/groups_short"], metrics["sampling/rounds"]) == (1, 3, 2)
    assert metrics["sampling/score_mean"] == pytest.approx((2 + 6 * 4) / 28)
    assert scores.tolist() == [0.0, 1.0, 0.0, 1.0] + [1.0] * 12  # the varied group's, then three uniform ones


def test_a_full_first_round_samples_nothing_more():
    sampler, scorer = ScriptedSampler(), ScriptedScorer({1: True, 2: True})
    first, rewards, scores, texts = first_round(sampler, scorer, [1, 2])
    refill = refill_of(sampler, scorer, dataset_of(4), max_rounds=10)
    rollout, _, _, _, metrics = refill.refill(first, rewards, scores, texts, 1, rloo.logs.StageTimer())
    assert sampler.asked == [] and rollout.prompts == first.prompts and metrics["sampling/discarded_tokens"] == 0


def test_resampled_prompts_depend_on_seed_update_and_round_only_and_split_between_processes():
    dataset = dataset_of(40)
    draw = lambda *key, **kw: data.resampled_prompts(dataset, 3, *key, **kw)["answer"]  # noqa: E731
    assert draw(1, 2, 1) == draw(1, 2, 1) and len(set(draw(1, 2, 1))) == 3
    assert len({tuple(draw(1, 2, 1)), tuple(draw(1, 2, 2)), tuple(draw(1, 3, 1)), tuple(draw(2, 2, 1))}) == 4
    both = draw(1, 2, 1, rank=0, world_size=2) + draw(1, 2, 1, rank=1, world_size=2)
    assert len(set(both)) == 6  # without replacement over both processes
    assert len(data.resampled_prompts(dataset_of(2), 3, 1, 1, 1)["answer"]) == 3  # a tiny dataset: with replacement


def test_sampling_seeds_are_consecutive_per_row_the_same_for_the_same_key_and_never_shared():
    """vLLM's samplers seed each completion by (--seed, update, round, row): consecutive in the row (vLLM seeds a
    request's completion i with seed + i), the same for the same key whatever the number of rows (a process takes its
    rows of the global batch's), none shared between runs' seeds, updates or rounds. What the engine receives in a run,
    the first round's those of a run without dynamic sampling: the next test."""
    streams = {(s, u, r): sampling_seeds(s, u, 8, r) for s in (7, 8) for u in (3, 4) for r in (0, 1, 2)}
    for (seed, update, round_), seeds in streams.items():
        assert seeds == list(range(seeds[0], seeds[0] + 8)), (seed, update, round_)
        assert sampling_seeds(seed, update, 3, round_) == seeds[:3]  # a row's seed does not depend on the rows after it
    every = [s for seeds in streams.values() for s in seeds]
    assert len(set(every)) == len(every)


class SeedRecordingEngine:
    """A stand-in for rloo_vllm.py's colocated engine that records the seeds of each generate call and completes every
    prompt with the same tokens: every group's rewards agree, so --dynamic_sampling runs all its rounds."""

    def __init__(self):
        self.dtype, self.last_push_bytes, self.seeds = None, 0, []

    def generate(self, prompts, options, seeds, images=None):
        self.seeds.append(list(seeds))
        return [([5, 6, options["stop_token_ids"][0]], [-6.0] * 3) for _ in prompts]

    def sleep(self):
        pass

    def push_weights(self, policy, weights):
        pass

    def close(self):
        pass


def engine_seeds(argv: list, cwd, monkeypatch) -> list[list[int]]:
    """The seeds of each generate call of rloo_vllm.main run in this process on argv, with a SeedRecordingEngine (the
    check of the engine's log-probs, which needs vLLM's, left out)."""
    engine = SeedRecordingEngine()
    run_rloo_vllm_in_process(monkeypatch, argv, cwd, lambda *args, **kwargs: engine, lambda *args: None)
    return engine.seeds


def test_the_engine_gets_the_first_rounds_seeds_of_a_run_without_dynamic_sampling_and_new_ones_each_round(
    tiny, prompts_file, tmp_path, monkeypatch
):
    """rloo_vllm.main, 2 updates of 2 groups of 4, every group uniform (SeedRecordingEngine): with --dynamic_sampling
    and 3 rounds the engine gets 6 calls; each update's first is the call of the same run without dynamic sampling,
    each call's seeds are consecutive, and no seed comes twice."""
    argv = ["--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file, "--total_episodes", 16]
    argv += ["--per_device_train_batch_size", 8, "--num_generations", G, "--max_completion_length", 8, "--seed", 7]
    argv += ["--num_sample_generations", 0, "--reward_funcs", f"{REWARDS}:text_length", "--beta", 0]
    (tmp_path / "plain").mkdir(), (tmp_path / "dynamic").mkdir()
    plain = engine_seeds(argv, tmp_path / "plain", monkeypatch)
    dynamic = engine_seeds([*argv, "--dynamic_sampling", "--max_sampling_rounds", 3], tmp_path / "dynamic", monkeypatch)
    assert [len(seeds) for seeds in plain] == [8, 8] and [len(seeds) for seeds in dynamic] == [8] * 6
    assert [dynamic[0], dynamic[3]] == plain  # each update's first round: what the run without dynamic sampling drew
    for seeds in dynamic:
        assert seeds == list(range(seeds[0], seeds[0] + 8))  # a group's seeds consecutive, as one request's are
    every = [s for seeds in dynamic for s in seeds]
    assert len(set(every)) == len(every)  # every round of every update draws from seeds of its own


def test_max_sampling_rounds_below_one_or_without_dynamic_sampling_is_refused(tiny):
    args = rloo.Args(model_name_or_path=tiny["policy"], dynamic_sampling=True, max_sampling_rounds=0)
    with pytest.raises(UsageError, match="--max_sampling_rounds must be > 0, got 0"):
        check_args(args)
    args = rloo.Args(model_name_or_path=tiny["policy"], max_sampling_rounds=3)
    with pytest.raises(
        UsageError, match="--max_sampling_rounds 3 bounds --dynamic_sampling's rounds, and the run does"
    ):
        check_args(args)
    check_args(rloo.Args(model_name_or_path=tiny["policy"], dynamic_sampling=True, max_sampling_rounds=3))


# ---- End to end ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def split_prompts(prompts_file, tmp_path_factory):
    """The tests' prompts as a train split, and a test split of 4 of them: held-out evaluation."""
    folder = tmp_path_factory.mktemp("splits")
    shutil.copy(prompts_file, folder / "train.jsonl")
    with open(prompts_file) as f:
        (folder / "test.jsonl").write_text("".join(f.readlines()[:4]))
    return str(folder)


REWARD = "first_token_is_a_multiple_of_4_logging_its_prompt"  # 0/1, and each row's prompt as scored, in the table


def dynamic_args(tiny, prompts_file, *extra):
    """6 updates of 4 groups of 4 on the tiny model, rewarded 0/1 (about a third of the groups all 0), a checkpoint
    every 3 updates, sample tables."""
    return [
        *("--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file, "--total_episodes", 96),
        *("--reward_funcs", f"{REWARDS}:{REWARD}", "--num_generations", G),
        *("--per_device_train_batch_size", 16, "--max_completion_length", 6, "--learning_rate", 3e-3, "--beta", 0.1),
        *("--dynamic_sampling", "--max_sampling_rounds", 3, "--save_steps", 3, "--run_name", "run", "--seed", 2),
        *("--num_sample_generations", 2, "--log_completions"),
        *extra,
    ]


def check_dynamic_metrics(rows: list[dict], groups: int) -> None:
    """Every update holds its groups (kept, or filling what the rounds left), and something was dropped, resampled."""
    for row in rows:
        assert row["sampling/groups_kept"] + row["sampling/groups_short"] == groups, row
        assert 1 <= row["sampling/rounds"] <= 3
        assert row["sampling/groups_sampled"] >= groups + row["sampling/groups_zero_std"] - row["sampling/groups_short"]
        assert row["sampling/generated_tokens"] >= row["sampling/discarded_tokens"] >= 0
    assert sum(row["sampling/groups_zero_std"] for row in rows) > 0 and max(r["sampling/rounds"] for r in rows) > 1
    resampled = [row for row in rows if row["sampling/rounds"] > 1]
    assert all(row["time/resampling"] > 0 and row["sampling/discarded_tokens"] > 0 for row in resampled)


def check_trained_groups(run_root, groups: int) -> None:
    """What each update trained on (its rows of completions.jsonl, --log_completions) against its metrics: `groups`
    groups of G adjacent rows, each of one prompt, the prompt its reward function scored (a rollout other than the one
    scored fails here); as many groups vary in reward as `sampling/groups_kept` (a kept group varies), and the others,
    `sampling/groups_short`, are dropped groups filling the places the rounds left, uniform. In a varied group every
    completion rewarded 1 has a higher advantage than every one rewarded 0 (leave-one-out over the rewards less beta 0.1
    times each completion's KL, which moves them by far less than 1 here): the update's advantages are of these
    rewards."""
    tables = {}
    with open(os.path.join(run_root, "runs", "run", "completions.jsonl")) as f:
        for row in map(json.loads, f):
            tables.setdefault(row["step"], []).append(row)
    updates = read_metrics(run_root)
    assert sorted(tables) == [row["step"] for row in updates]
    for update in updates:
        table = tables[update["step"]]
        assert len(table) == groups * G, update["step"]
        varied = 0
        for group in (table[g * G : (g + 1) * G] for g in range(groups)):
            assert len({row["prompt"] for row in group}) == 1, group
            assert [row["scored_prompt"] for row in group] == [row["prompt"] for row in group], group
            rewards = [row[REWARD] for row in group]
            assert set(rewards) <= {0.0, 1.0}, group
            if len(set(rewards)) > 1:
                varied += 1
                rewarded = [row["advantage"] for row in group if row[REWARD] == 1.0]
                unrewarded = [row["advantage"] for row in group if row[REWARD] == 0.0]
                assert min(rewarded) > max(unrewarded), group
        assert (varied, groups - varied) == (update["sampling/groups_kept"], update["sampling/groups_short"]), update


@pytest.mark.slow
def test_rloo_py_with_dynamic_sampling_trains_and_a_sigkilled_run_resumes_as_the_same_run(
    tiny, split_prompts, tmp_path
):
    """The extra rounds' prompts are a function of (seed, update, round) and HF generate draws from torch's generator,
    which a checkpoint keeps: the resumed run equals the uninterrupted one, metrics, evaluations, sample tables and
    weights."""
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    reference.mkdir(), interrupted.mkdir()
    prompts_file = split_prompts  # with a test split: the held-out evaluation every 2 updates
    proc = run_rloo(*dynamic_args(tiny, prompts_file, "--eval_steps", 2), cwd=reference)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = run_outcome(str(reference / "runs" / "run"))
    check_dynamic_metrics(read_metrics(reference), groups=4)
    check_trained_groups(reference, groups=4)
    assert len([row for row in expected[0] if "eval/reward" in row]) == 4  # before training, after updates 2, 4, 6

    killed = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "rloo.py"), *map(str, dynamic_args(tiny, prompts_file, "--eval_steps", 2))],
        cwd=interrupted,
        env=run_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_updates(killed, interrupted / "runs" / "run" / "metrics.jsonl", 4)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    resumed = run_rloo(
        *dynamic_args(tiny, prompts_file, "--eval_steps", 2, "--resume_from_checkpoint", "latest"), cwd=interrupted
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = run_outcome(str(interrupted / "runs" / "run"))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert all(torch.equal(got[2][k], expected[2][k]) for k in expected[2])
    completions = [folder / "runs" / "run" / "completions.jsonl" for folder in (interrupted, reference)]
    assert completions[0].read_text() == completions[1].read_text()  # the resumed run trained on the same rows


@pytest.mark.slow
def test_rloo_vllm_py_with_dynamic_sampling_colocated_and_on_a_server_with_max_staleness(
    tiny, server, prompts_file, tmp_path
):
    """Colocated: the extra rounds seeded per (update, round, row). On a server with --max_staleness 1: the first round
    comes from the queue (weights one update old), the extra rounds from the newest weights when the update asks."""
    for mode in (
        ["--vllm_mode", "colocate"],
        ["--vllm_mode", "server", "--vllm_server_base_url", server["url"], "--max_staleness", 1],
    ):
        cwd = tmp_path / mode[1]
        cwd.mkdir()
        proc = run_rloo(*dynamic_args(tiny, prompts_file, *mode), cwd=cwd, script="rloo_vllm.py")
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = read_metrics(cwd)
        check_dynamic_metrics(rows, groups=4)
        check_trained_groups(cwd, groups=4)
        assert all(row["optim/grad_norm"] > 0 for row in rows)
        if "--max_staleness" in mode:
            assert [row["async/staleness"] for row in rows] == [0, 1, 1, 1, 1, 1]


@pytest.mark.slow
def test_rloo_multigpu_py_with_dynamic_sampling_on_two_processes(tiny, prompts_file, tmp_path):
    """Each process keeps its own groups; every process samples every round, as many prompts as the process that misses
    most (a process that disagreed would leave the other waiting in a collective, and the run would time out)."""
    proc = run_torchrun(2, *dynamic_args(tiny, prompts_file, "--per_device_train_batch_size", 8), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_dynamic_metrics(read_metrics(tmp_path), groups=4)
    check_trained_groups(tmp_path, groups=4)
