"""Held-out evaluation: when a run evaluates, the random streams it samples from, each process's share of the test
prompts, what evaluation-only metric functions return, and the task metrics (mean@n, best@k, pass@k, per data source)
of the completions. The scripts generate and score; the names of what they log are in docs/metrics.md."""

import contextlib
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
import torch

from rloo_utils.data import message_text, repeated
from rloo_utils.errors import UsageError
from rloo_utils.logs import completion_metrics, gather_objects, reward_metrics, show_samples
from rloo_utils.processes import agreed, gather_rows, get_rank, get_world_size
from rloo_utils.rewards import check_reward_values, load_reward_func, reward_func_name, weighted_reward


@dataclass
class EvaluationOptions:
    """Held-out evaluation on the test split (its metrics: docs/metrics.md)"""

    # the held-out evaluation samples from random streams of its own: the run trains as it would without it
    RESUMABLE: ClassVar = {
        "eval_steps",
        "eval_on_start",
        "max_eval_prompts",
        "num_generations_eval",
        "eval_temperature",
        "eval_success_threshold",
        "eval_metric_funcs",
    }

    eval_steps: float = 0.5
    """evaluate on the test split every N updates (below 1: that fraction of the run) and at the end; 0: never"""
    eval_on_start: bool = True
    """also evaluate before the first update (TRL's name; with --eval_steps > 0)"""
    max_eval_prompts: Optional[int] = None
    """evaluate on the first N prompts of the test split; None: all of them"""
    num_generations_eval: Optional[int] = None
    """completions per test prompt, the n of mean@n and best@k / pass@k; None: --num_generations"""
    eval_temperature: Optional[float] = None
    """the evaluation's sampling temperature (0: greedy, with --num_generations_eval 1); None: --temperature"""
    eval_success_threshold: Optional[float] = None
    """a completion whose reward is at least this is a success, and pass@k is logged; None: no such test"""
    eval_metric_funcs: Optional[list[str]] = None
    """metrics of the evaluation only, never trained on (the reward-function signature; booleans give pass@k)"""

    def check(self) -> None:
        """The held-out evaluation's options, alone and against the training's."""
        if self.eval_steps < 0 or self.eval_steps >= 1 and self.eval_steps != int(self.eval_steps):
            raise UsageError(
                "--eval_steps must be a whole number of updates, a fraction of the run below 1, or 0 for no "
                f"evaluation, got {self.eval_steps:g}"
            )
        for name in ["max_eval_prompts", "num_generations_eval"]:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UsageError(f"--{name} must be at least 1 (or left out), got {getattr(self, name)}")
        if self.eval_temperature is not None and self.eval_temperature < 0:
            raise UsageError(f"--eval_temperature must be >= 0 (0: greedy), got {self.eval_temperature}")
        n = self.num_generations_eval or self.num_generations
        if self.eval_temperature == 0 and n > 1:
            raise UsageError(
                f"--eval_temperature 0 samples greedily, so the {n} completions of a test prompt would all be the "
                "same: add --num_generations_eval 1"
            )

    def derived_defaults(self) -> dict:
        """The evaluation's sampling where it is not given: the training's."""
        return {
            "num_generations_eval": self.num_generations_eval or self.num_generations,
            "eval_temperature": self.temperature if self.eval_temperature is None else self.eval_temperature,
        }


# The column that names each test prompt's data source (veRL's name): its metrics are also logged per source
DATA_SOURCE_COLUMN = "data_source"


def metric_funcs(eval_metric_funcs: Optional[list[str]], builtin: dict) -> tuple[list, list[str]]:
    """The evaluation metric functions (--eval_metric_funcs: built-in names, a key of `builtin`, or module:function)
    and their names (what follows the last `:`), loaded now, before the run starts."""
    specs = eval_metric_funcs or []
    names = [reward_func_name(s) for s in specs]
    if len(set(names)) < len(names):
        raise UsageError(f"--eval_metric_funcs names a function twice ({', '.join(names)}): give each once")
    option = ("evaluation metric function", "--eval_metric_funcs")
    return [load_reward_func(s, builtin, *option) for s in specs], names


def evaluation_prompts(
    test_dataset,
    metric_names: list[str],
    *,
    dataset_name: str,
    dataset_test_split: str,
    eval_steps: float,
    max_eval_prompts: Optional[int],
    eval_success_threshold: Optional[float],
    eval_metric_funcs: Optional[list[str]],
):
    """The test prompts the run evaluates on: the first max_eval_prompts (--max_eval_prompts; None: all) of the
    held-out split, test_dataset; None where it does not evaluate (eval_steps, --eval_steps, 0; or no held-out split,
    which is an error where an option that means nothing without an evaluation asks for one: --max_eval_prompts,
    --eval_success_threshold, --eval_metric_funcs). dataset_name, dataset_test_split: what that error names;
    metric_names: the metric functions', checked against the data sources' (check_evaluation_names)."""
    if test_dataset is None:
        evaluation_only = [
            ("max_eval_prompts", max_eval_prompts),
            ("eval_success_threshold", eval_success_threshold),
            ("eval_metric_funcs", eval_metric_funcs),
        ]
        asked = [f"--{name}" for name, value in evaluation_only if value is not None]
        if asked:
            raise UsageError(
                f"{asked[0]} is for the held-out evaluation, but dataset {dataset_name} has no split "
                f"{dataset_test_split!r} (--dataset_test_split; a single file is one split): give a folder with "
                "a train and a test file, or leave it out"
            )
        return None
    if eval_steps == 0:
        return None
    prompts = test_dataset.select(range(min(len(test_dataset), max_eval_prompts or len(test_dataset))))
    check_evaluation_names(metric_names, data_sources(prompts))
    return prompts


def data_sources(prompts) -> Optional[list[str]]:
    """Each prompt's data source, where the dataset has a column naming it; None where it has none."""
    return [str(s) for s in prompts[DATA_SOURCE_COLUMN]] if DATA_SOURCE_COLUMN in prompts.column_names else None


def evaluation_updates(eval_steps: float, eval_on_start: bool, num_updates: int) -> set[int]:
    """The updates after which the run evaluates (0: before the first): every eval_steps updates (below 1, that
    fraction of the run, rounded up, as TRL's eval_steps), and after the last; none when eval_steps is 0."""
    if eval_steps == 0:
        return set()
    every = math.ceil(eval_steps * num_updates) if eval_steps < 1 else int(eval_steps)
    return {*range(every, num_updates + 1, every), num_updates, *([0] if eval_on_start else [])}


def evaluation_seeds(seed: int, update: int, first_row: int, num_rows: int) -> list[int]:
    """One seed per completion of the evaluation after `update`, from a stream of its own (the training rollouts draw
    from SeedSequence([seed, update])): a function of (--seed, update, row) only, so that a resumed run evaluates as
    the uninterrupted one did, and the rows of a process are those of one process doing all of them."""
    base = int(np.random.SeedSequence([seed, update, 1]).generate_state(1)[0])
    return [base + first_row + row for row in range(num_rows)]


@contextlib.contextmanager
def own_random_streams(seed: int, update: int, device: torch.device):
    """Python's, numpy's and torch's global generators (CUDA's too) seeded for the evaluation after `update` and
    restored after it, whatever the reward and metric functions draw: the run trains exactly as it would without
    evaluating, and a resumed run as the uninterrupted one."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        evaluation_seed = evaluation_seeds(seed, update, 0, 1)[0]
        random.seed(evaluation_seed)
        np.random.seed(evaluation_seed)
        torch.manual_seed(evaluation_seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def process_share(num_prompts: int, rank: int, world_size: int) -> list[int]:
    """The indices of one process's test prompts: as many for every process, so that they generate in step, the last
    shares running past the end, where they repeat prompt 0 (dropped once gathered: see num_prompts)."""
    per_process = math.ceil(num_prompts / world_size)
    return [i if i < num_prompts else 0 for i in range(rank * per_process, (rank + 1) * per_process)]


def check_metric_values(values, name: str, batch_size: int) -> tuple[torch.Tensor, Optional[bool]]:
    """What an evaluation metric function returned: (B,) floats, NaN for None, and whether they are booleans (a
    success test, whose pass@k is logged), None where every one was None. Booleans or numbers, not both."""
    if (torch.is_tensor(values) or isinstance(values, np.ndarray)) and values.ndim == 1:
        values = values.tolist()  # (a bool tensor's values as booleans)
    kinds = {isinstance(v, (bool, np.bool_)) for v in values if v is not None} if isinstance(values, list) else set()
    if kinds == {True}:
        return torch.tensor([math.nan if v is None else float(v) for v in values]), True
    if kinds == {True, False}:
        raise UsageError(
            f"evaluation metric function {name} returned both booleans and numbers: return booleans (a success "
            "test, scored with pass@k) or numbers, and None where it does not apply"
        )
    values = check_reward_values(values, name, batch_size, "evaluation metric function")
    return values, None if values.isnan().all() else False


def joined_metric_values(chunks: list[list], names: list[str], n: int) -> dict[str, tuple[torch.Tensor, bool]]:
    """Each chunk's check_metric_values of every function -> name: ((prompts, n) values, whether booleans)."""
    joined = {}
    for j, name in enumerate(names):
        kinds = {chunk[j][1] for chunk in chunks} - {None}
        if len(kinds) > 1:
            raise UsageError(
                f"evaluation metric function {name} returned booleans for some test prompts and numbers for others: "
                "return one kind, and None where it does not apply"
            )
        joined[name] = torch.cat([chunk[j][0] for chunk in chunks]).view(-1, n), kinds == {True}
    return joined


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k completions drawn from n, c of them successes, is a success: the
    unbiased estimator 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
    eq. 1), as their numerically stable product."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def best_at_k(values: list[float], k: int) -> float:
    """The expected largest of k values drawn without replacement from these n (veRL's best@k, unbiased): the i-th
    smallest is the largest of the k with probability C(i - 1, k - 1) / C(n, k). On 0/1 values it is pass@k."""
    ordered = sorted(values)
    return sum(math.comb(i, k - 1) * v for i, v in enumerate(ordered)) / math.comb(len(ordered), k)


def sample_counts(n: int) -> list[int]:
    """The k of best@k and pass@k: 1, 2, 4, ... below n, and n."""
    return [*(2**i for i in range(n.bit_length()) if 2**i < n), n]


def per_prompt(values: torch.Tensor) -> list[list[float]]:
    """(P, n) values, NaN where a function returned None -> each prompt's values that it did return."""
    return [[v for v in row if not math.isnan(v)] for row in values.tolist()]


def task_metrics(
    rewards: torch.Tensor, metric_values: dict[str, tuple[torch.Tensor, bool]], success_threshold: Optional[float]
) -> dict[str, float]:
    """The task metrics of (P, n) rewards, the n completions of each of P prompts: mean@n (the mean over prompts of
    each prompt's mean), best@k, and pass@k of the success test reward >= success_threshold (when given); of each
    evaluation metric function's (P, n) values, <name>/mean@n and <name>/best@k, or <name>/pass@k when it returns
    booleans. A None (NaN) is left out: a prompt's k is at most the values it has, one with none is left out."""
    n = rewards.shape[1]
    metrics = at_k(per_prompt(rewards), n, boolean=False)
    if success_threshold is not None:
        success = torch.where(rewards.isnan(), math.nan, (rewards >= success_threshold).float())
        metrics.update(at_k(per_prompt(success), n, boolean=True, mean=False))
    for name, (values, boolean) in metric_values.items():
        metrics.update({f"{name}/{k}": v for k, v in at_k(per_prompt(values.view(-1, n)), n, boolean).items()})
    return metrics


def at_k(prompts: list[list[float]], n: int, boolean: bool, mean: bool = True) -> dict[str, float]:
    """mean@n (when mean), and pass@k (boolean) or best@k of each prompt's values, averaged over the prompts."""
    prompts = [p for p in prompts if p]
    if not prompts:
        return {}
    metrics = {f"mean@{n}": sum(sum(p) / len(p) for p in prompts) / len(prompts)} if mean else {}
    for k in sample_counts(n):
        if boolean:
            values = [pass_at_k(len(p), round(sum(p)), min(k, len(p))) for p in prompts]
        else:
            values = [best_at_k(p, min(k, len(p))) for p in prompts]
        metrics[f"{'pass' if boolean else 'best'}@{k}"] = sum(values) / len(values)
    return metrics


def per_source_metrics(
    rewards: torch.Tensor,
    metric_values: dict[str, tuple[torch.Tensor, bool]],
    success_threshold: Optional[float],
    sources: list,
) -> dict[str, float]:
    """task_metrics of each data source's prompts (sources: one per prompt), as <source>/<metric>, and its reward."""
    metrics = {}
    for source in dict.fromkeys(sources):
        rows = torch.tensor([s == source for s in sources])
        scored = rewards[rows][~rewards[rows].isnan()]
        metrics[f"{source}/reward"] = float(scored.mean()) if len(scored) else math.nan
        own = task_metrics(
            rewards[rows], {name: (v[rows], b) for name, (v, b) in metric_values.items()}, success_threshold
        )
        metrics.update({f"{source}/{name}": value for name, value in own.items()})
    return metrics


# The first part of the names the evaluation logs itself: a data source or a metric function must not take one
OWN_NAMES = {"reward", "reward_std", "rewards", "frac_reward_zero_std", "completions", "val", "seconds", "prompts"}


def check_evaluation_names(metric_names: list[str], sources: Optional[list]) -> None:
    """Every name a value is logged under is one value's: a metric function's, a data source's, the evaluation's own."""
    seen = {}
    for kind, name in [("evaluation metric function", m) for m in metric_names] + [
        (f"data source (column {DATA_SOURCE_COLUMN})", s) for s in dict.fromkeys(sources or [])
    ]:
        if name in OWN_NAMES or "@" in name or name in seen:
            taken = seen.get(name, "the evaluation's own metrics")
            raise UsageError(
                f"{kind} {name!r} would be logged as eval/{name}/..., a name that {taken} takes: rename it"
            )
        seen[name] = f"the {kind} {name!r}"


def evaluation_plan(
    prompts,
    updates: set[int],
    *,
    dataset_name: str,
    dataset_test_split: str,
    eval_steps: float,
    num_generations_eval: int,
    eval_temperature: float,
) -> str:
    """The start-up line that says when and on what the run evaluates: the test prompts (None: no evaluation, for want
    of a held-out split, dataset_test_split of dataset_name, or with eval_steps 0), the updates after which it
    evaluates, and its num_generations_eval completions of each prompt at eval_temperature."""
    if prompts is None:
        return (
            f"no held-out evaluation: dataset {dataset_name} has no split {dataset_test_split!r}"
            if eval_steps
            else "no held-out evaluation (--eval_steps 0)"
        )
    return (
        f"held-out evaluation on {len(prompts)} prompts of split {dataset_test_split} x "
        f"{num_generations_eval} completions at temperature {eval_temperature:g}, after updates "
        f"{', '.join(map(str, sorted(updates)))}"
    )


def evaluation_summary(metrics: dict, update: int, n: int) -> str:
    """The line an evaluation prints: its reward, mean@n and best@n (pass@n with a success test), and its seconds."""
    shown = [
        f"{name} {metrics[name]:.3f}" for name in ["reward", f"best@{n}", "pass@1", f"pass@{n}"] if name in metrics
    ]
    return f"evaluation after update {update}: {', '.join(shown)} ({metrics['seconds']:.1f} s)"


class Evaluator:
    """What the run shows of the policy besides training: greedy sample tables of a few fixed prompts, and the held-out
    evaluation (--eval_steps) of the test prompts, from random streams of its own (the run trains as it would
    without it). One for the three scripts: their sampler and scorer do the work; in a run of several processes each
    evaluates its share of the test prompts, and the results are gathered."""

    def __init__(self, args, plan, sampler, scorer, console, logger):
        """sampler and scorer: the run's seams, which generate and score (its reward weights are the scorer's; the
        sampler's configs, the greedy one for the sample tables and the evaluation's, and its eos_ids, the tokens that
        end a completion, for its length metrics); console and logger: where tables and metrics go.
        The sample tables: the first --num_sample_prompts prompts of the plan's (set_up.RunPlan) eval_dataset, or of
        its train_dataset where there is no held-out split, with those of their extra_columns they hold (the dataset's
        columns besides the prompt, which reward functions get), --num_sample_generations times in a run (0: none),
        and of the trained policy.
        The evaluation (the plan's eval_prompts, evaluate_after, metric_funcs and metric_names): the test prompts
        (None: none), the updates after which they are evaluated, the --eval_metric_funcs and their names;
        --num_generations_eval completions of each prompt at --eval_temperature (their defaults resolved), a success
        where the reward reaches --eval_success_threshold (None: no success test), sampled
        --local_rollout_forward_batch_size completions at a time from seeds of --seed and the update. --dataset_name,
        --dataset_test_split and --eval_steps: what plan() says of a run that does not evaluate."""
        self.sampler, self.scorer = sampler, scorer
        self.eval_prompts, self.evaluate_after = plan.eval_prompts, plan.evaluate_after
        table = (plan.eval_dataset or plan.train_dataset)[: args.num_sample_prompts]  # the test split's, or the train's
        self.table = (table["prompt"], {c: table[c] for c in plan.extra_columns if c in table})  # prompts, columns
        _, self.greedy_config, self.eval_config = sampler.configs
        self.sample_every = (
            max(1, plan.num_updates // args.num_sample_generations) if args.num_sample_generations else 0
        )
        self.metric_funcs, self.metric_names = plan.metric_funcs, plan.metric_names
        self.weights, self.eos_ids, self.console, self.logger = scorer.weights, sampler.eos_ids, console, logger
        self.n, self.temperature = args.num_generations_eval, args.eval_temperature
        self.success_threshold = args.eval_success_threshold
        self.forward_batch_size, self.seed = args.local_rollout_forward_batch_size, args.seed
        self.dataset_name, self.dataset_test_split, self.eval_steps = (
            args.dataset_name,
            args.dataset_test_split,
            args.eval_steps,
        )

    def plan(self) -> str:
        """One line: what the run evaluates and when (evaluation_plan)."""
        return evaluation_plan(
            self.eval_prompts,
            self.evaluate_after,
            dataset_name=self.dataset_name,
            dataset_test_split=self.dataset_test_split,
            eval_steps=self.eval_steps,
            num_generations_eval=self.n,
            eval_temperature=self.temperature,
        )

    def before_update(self, update: int, step: int, timer) -> None:
        """Before `update` (from 1): a sample table of the policy so far, every sample_every updates; the held-out
        evaluation of the policy after update - 1 (0: before training), where the plan says."""
        if self.sample_every and (update - 1) % self.sample_every == 0:
            with timer("sample_table"):
                self.sample_table(step)
        if update - 1 in self.evaluate_after:
            self.evaluate(update - 1, step)

    def after_training(self, update: int, step: int) -> None:
        """After the last update: the trained policy's sample table, and its held-out evaluation where the plan says."""
        if self.sample_every:
            self.sample_table(step)
        if update in self.evaluate_after:
            self.evaluate(update, step)

    def sample_table(self, step: int) -> None:
        """Greedy completions of the table's prompts (the test split's first --num_sample_prompts, or the train
        split's): printed, and logged as a table. With several processes every one generates them (a sharded forward
        needs all of them); rank 0 shows them."""
        prompts, columns = self.table
        rollout = self.sampler.sample(prompts, columns, self.greedy_config)
        with agreed():  # a reward function that raises on one process stops all of them together, as in the loop
            rewards, completions = self.scorer.score(rollout)
        self.scorer.logs.clear()  # what reward functions logged on these prompts is not the update's
        rewards = weighted_reward(rewards, self.weights).tolist()
        rows = [
            {"prompt": message_text(p), "completion": c, "reward": r} for p, c, r in zip(prompts, completions, rewards)
        ]
        show_samples(self.console, self.logger, rows, step)

    def evaluate(self, update: int, step: int) -> None:
        """The policy after `update` on the test prompts: --num_generations_eval completions of each at
        --eval_temperature, scored by the reward and the --eval_metric_funcs; their task metrics
        (rloo_utils/evaluation.py) logged under eval/. Each process evaluates its share of the prompts (as many as every
        other), and the results are gathered."""
        eval_prompts, scorer = self.eval_prompts, self.scorer
        start, n = time.perf_counter(), self.n
        prompts_per_chunk = max(1, self.forward_batch_size // n)
        own_prompts = eval_prompts.select(process_share(len(eval_prompts), get_rank(), get_world_size()))
        own_rows = get_rank() * len(own_prompts) * n  # this process's first row of the gathered completions
        parts = defaultdict(list)  # per chunk: (b, F) rewards, (b, C) completions and mask, (b,) ended, metric values
        with own_random_streams(self.seed, update, self.sampler.device):
            for first in range(0, len(own_prompts), prompts_per_chunk):
                batch = own_prompts[first : first + prompts_per_chunk]
                prompts, columns = repeated(batch, n)  # the n completions of a prompt adjacent
                seeds = evaluation_seeds(self.seed, update, own_rows + first * n, len(prompts))
                rollout = self.sampler.sample(prompts, columns, self.eval_config, seeds, n)
                with agreed():  # a reward function that raises on one process stops all of them together
                    rewards_per_func, completions = scorer.score(rollout)  # (b, F)
                    parts["metric_values"].append(
                        scorer.call(self.metric_funcs, self.metric_names, rollout, completions, check_metric_values)
                    )
                for name, value in [
                    ("rewards", rewards_per_func),
                    ("ids", rollout.completion_ids),
                    ("mask", rollout.policy_mask.long()),  # the policy's tokens: the lengths count these
                    ("ended", rollout.ended),
                ]:
                    parts[name].append(value)
            scorer.logs.clear()  # what the functions logged on the test prompts is no update's
        num_rows = len(eval_prompts) * n  # of every process, in rank order, without the repeated prompts
        rewards_per_func, completion_ids, completion_mask, ended = (
            gather_rows(torch.cat(parts[name]))[:num_rows] for name in ["rewards", "ids", "mask", "ended"]
        )  # (R, F), (R, C), (R, C), (R,): R = n completions of each test prompt
        rewards = weighted_reward(rewards_per_func, self.weights).view(-1, n)  # (prompts, n)
        values = {
            name: (v[: len(eval_prompts)], boolean)
            for name, (v, boolean) in joined_metric_values(
                gather_objects(parts["metric_values"]), self.metric_names, n
            ).items()
        }  # name -> ((prompts, n), boolean)
        sources = data_sources(eval_prompts)
        metrics = {
            **reward_metrics(rewards_per_func, scorer.names, self.weights, rewards.view(-1), n),  # TRL's eval_ names
            **completion_metrics(completion_ids, completion_mask, ended, self.eos_ids),
            **task_metrics(rewards, values, self.success_threshold),
            **(per_source_metrics(rewards, values, self.success_threshold, sources) if sources else {}),
            "prompts": len(eval_prompts),
            "seconds": time.perf_counter() - start,
        }
        self.logger.log(metrics, step, "eval")
        self.console.print(evaluation_summary(metrics, update, n))
