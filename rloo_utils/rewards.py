"""Reward functions: loaded by name, called (async ones together) under --reward_timeout, their values checked; what
they get besides the completions (TRL's trainer_state) and what they log; the reward model's inputs in its own
tokenizer."""

import asyncio
import functools
import importlib
import importlib.util
import inspect
import math
import os
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Annotated, Callable, ClassVar, Optional

import numpy as np
import torch
import torch.distributed as dist
import tyro

from rloo_utils.data import REWARD_FUNC_ARGUMENTS, content_text, left_pad, message_text
from rloo_utils.errors import RunError, UsageError, describe
from rloo_utils.packing import last_true_index, pack_sequences, packing_layout, position_ids_from, varlen_kwargs
from rloo_utils.processes import get_rank
from rloo_utils.verifiable import REWARD_FUNCS as VERIFIABLE_REWARD_FUNCS


@dataclass
class RewardSourceOptions:
    """Where the score comes from: a reward model, reward functions in TRL's signature, or both, weighted"""

    RESUMABLE: ClassVar = {"reward_timeout"}  # a slow reward function changes no score (options.resumable_options)

    reward_model_path: Optional[str] = None
    """a sequence classification model (num_labels=1), read at the last real token"""
    reward_funcs: Optional[list[str]] = None
    """built-in names, `module:function` or `file.py:function`; None: vader_sentiment without a reward model"""
    reward_weights: Optional[list[float]] = None
    """one weight per reward source, the reward model first; None: all 1.0"""
    reward_timeout: Optional[float] = None
    """seconds a reward function's call may take; past it the run stops with a checkpoint; None: no limit"""
    overlong_buffer_length: Annotated[Optional[int], tyro.conf.arg(aliases=("--soft_punish_cache",))] = None
    """(soft_overlong_punishment) tokens before --max_completion_length over which its penalty grows; None: a fifth"""
    overlong_penalty_factor: float = 1.0
    """(soft_overlong_punishment) its penalty at --max_completion_length, which a truncated completion gets whole"""

    def check(self) -> None:
        """The reward timeout; the soft overlong punishment's options shape its reward function only, and its buffer
        fits the completion (the sources themselves are loaded, and checked, by reward_sources)."""
        if self.reward_timeout is not None and not self.reward_timeout > 0:
            raise UsageError(f"--reward_timeout must be > 0, got {self.reward_timeout}")
        used = "soft_overlong_punishment" in (self.reward_funcs or [])
        given = [
            f"--{name} {getattr(self, name)}"
            for name, default in [("overlong_buffer_length", None), ("overlong_penalty_factor", 1.0)]
            if getattr(self, name) != default
        ]
        if given and not used:
            raise UsageError(
                f"{' and '.join(given)} {'are' if len(given) > 1 else 'is'} for the reward function "
                "soft_overlong_punishment, which --reward_funcs does not name: add it (--reward_funcs "
                "soft_overlong_punishment ...), or leave the option out"
            )
        buffer = self.overlong_buffer_length
        if buffer is not None and not 0 < buffer <= self.max_completion_length:
            raise UsageError(
                f"--overlong_buffer_length must be in [1, --max_completion_length {self.max_completion_length}] (the "
                f"last tokens before the limit, over which the penalty grows), got {buffer}"
            )
        if self.overlong_penalty_factor < 0:
            raise UsageError(
                f"--overlong_penalty_factor must be >= 0 (the penalty subtracted at the limit), got "
                f"{self.overlong_penalty_factor}"
            )


def reward_model_inputs(
    reward_tokenizer,
    prompts: list,
    completions: list[str],
    ended: torch.Tensor,
    chat_template_kwargs: Optional[dict] = None,
):
    """Left-padded (B, L) ids and mask for a reward model with a tokenizer of its own, from the decoded completions.
    A conversation goes through its chat template, which closes the assistant's turn; plain text is prompt + completion
    with its special tokens, and its EOS after a completion that ended: the score is read where the policy's own ids
    would have it, at the EOS of a finished completion and at the last token of a truncated one. chat_template_kwargs:
    the template's own arguments (--chat_template_kwargs)."""
    rows = []
    for prompt, completion, done in zip(prompts, completions, ended.tolist()):
        if isinstance(prompt, str):
            row = reward_tokenizer(prompt + completion)["input_ids"]
            if done and reward_tokenizer.eos_token_id is not None and row[-1] != reward_tokenizer.eos_token_id:
                row.append(reward_tokenizer.eos_token_id)
        else:
            prompt = [{**m, "content": content_text(m["content"])} for m in prompt]  # a reward model reads text
            text = reward_tokenizer.apply_chat_template(
                prompt + [{"role": "assistant", "content": completion}], tokenize=False, **(chat_template_kwargs or {})
            )
            row = reward_tokenizer(text, add_special_tokens=False)["input_ids"]
        rows.append(row)
    return left_pad(rows, reward_tokenizer.pad_token_id if reward_tokenizer.pad_token_id is not None else 0)


def reward_func_name(spec: str) -> str:
    """The name a reward function's metrics go under: the built-in name, or what follows the last `:`."""
    return spec.rsplit(":", 1)[-1]


def load_reward_func(
    spec: str, builtin: dict[str, Callable], what: str = "reward function", option: str = "--reward_funcs"
) -> Callable:
    """A built-in name (a key of `builtin`), `package.module:function`, or `path/to/file.py:function` (any callable: a
    function, an instance with __call__, a functools.partial): a `what` given to `option`."""
    if spec in builtin:
        return builtin[spec]
    if ":" not in spec:
        raise UsageError(
            f"unknown {what} {spec!r}: use one of {sorted(builtin)}, module:function or path/to/file.py:function"
        )
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise UsageError(f"{what} file {where} does not exist")
            module_spec = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except UsageError:
        raise
    except (Exception, SystemExit) as e:  # SystemExit: a module that calls sys.exit when imported
        raise UsageError(f"could not import {what} {spec!r} ({describe(e)})") from None
    func = getattr(module, name, None)
    if not callable(func):
        raise UsageError(f"{where} has no function {name!r} (from {option} {spec})")
    return func


def reward_func_arguments(
    prompts: list, texts: list[str], completion_ids, completion_mask, messages: Optional[list] = None
) -> dict:
    """What every reward function gets of the completions (TRL's arguments): the prompts, the completions (as the
    assistant's message where the prompts are chat messages; a multi-turn rollout's `messages`: its turns with their
    tool calls, and the tools' results), and each one's token ids without padding."""
    conversational = not isinstance(prompts[0], str)
    if messages is None and conversational:
        messages = [[{"role": "assistant", "content": t}] for t in texts]
    return dict(
        prompts=prompts,
        completions=messages if conversational else texts,
        completion_ids=[row[m.bool()].tolist() for row, m in zip(completion_ids, completion_mask)],
    )


def reward_sources(
    builtin: dict[str, Callable],
    environment_rewards: list = (),
    *,
    reward_model_path: Optional[str],
    reward_funcs: Optional[list[str]],
    reward_weights: Optional[list[float]],
) -> tuple[list[Callable], list[str], torch.Tensor]:
    """The reward functions, the names of every source (the reward model first, the environments' get_reward last)
    and their (F,) weights; `builtin`: the functions a script offers by name; environment_rewards: (name, function)
    of each environment class with a get_reward, weight 1 (as in TRL), which --reward_weights does not cover.
    reward_model_path: the reward model (--reward_model_path; None: none); reward_funcs: the functions' specs
    (--reward_funcs; None: vader_sentiment where no other source scores); reward_weights: one per source but the
    environments', the reward model first (--reward_weights; None: all 1.0)."""
    owned = reward_model_path or environment_rewards
    specs = reward_funcs if reward_funcs is not None else ([] if owned else ["vader_sentiment"])
    names = ([os.path.basename(reward_model_path.rstrip("/"))] if reward_model_path else []) + [
        reward_func_name(s) for s in specs
    ]
    given = len(names)  # the sources --reward_weights weighs
    names += [name for name, _ in environment_rewards]
    if not names:
        raise UsageError("no reward: give --reward_model_path and/or --reward_funcs")
    if len(set(names)) < len(names):
        raise UsageError(
            f"two reward sources have the same name ({', '.join(names)}), so their metrics would mix: "
            "give each function once, under its own name"
        )
    weights = torch.tensor(reward_weights or [1.0] * given)
    if len(weights) != given:
        raise UsageError(
            f"--reward_weights has {len(weights)} values for {given} reward sources ({', '.join(names[:given])})"
        )
    weights = torch.cat([weights, torch.ones(len(names) - given)])
    if not weights.any():
        raise UsageError(
            "--reward_weights are all 0: no reward would reach the advantages, and the run would train on "
            "nothing but its KL penalty; give a source a weight"
        )
    return [load_reward_func(s, builtin) for s in specs] + [f for _, f in environment_rewards], names, weights


def check_reward_columns(
    reward_funcs,
    reward_names,
    metric_funcs,
    metric_names,
    train_dataset,
    eval_dataset,
    *,
    num_sample_generations: int,
    eval_steps: float,
    multi_turn: bool,
) -> None:
    """Every argument a reward function (or evaluation metric function) needs, one without a default, is one it is
    given: TRL's arguments, a column of the dataset (answer_accuracy reads `answer`), or a multi-turn rollout's
    `environments` and `environment_rewards` (multi_turn: --tools or --environment given). Else one line now, before
    the models load, rather than a TypeError at the first update. Reward functions score the training split, and the
    held-out one where the sample tables (num_sample_generations: --num_sample_generations) or the evaluation
    (eval_steps: --eval_steps) read it; metric functions the held-out split where the run evaluates."""
    reward_names = reward_names[len(reward_names) - len(reward_funcs) :]  # without the reward model's
    checks = [(f, n, "reward function", train_dataset) for f, n in zip(reward_funcs, reward_names)]
    if eval_dataset is not None and (num_sample_generations or eval_steps):
        checks += [(f, n, "reward function", eval_dataset) for f, n in zip(reward_funcs, reward_names)]
    if eval_dataset is not None and eval_steps:
        checks += [(f, n, "evaluation metric function", eval_dataset) for f, n in zip(metric_funcs, metric_names)]
    multi_turn = {"environments", "environment_rewards"} if multi_turn else set()
    for func, name, what, dataset in checks:
        try:
            parameters = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):  # a callable without a signature: its call says what it lacks
            continue
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        needed = [p.name for p in parameters if p.default is p.empty and p.kind in kinds]
        given = {*REWARD_FUNC_ARGUMENTS, *multi_turn} | set(dataset.column_names) - {"prompt"}
        absent = [p for p in needed if p not in given]
        if absent:
            split = "training" if dataset is train_dataset else "held-out"
            raise UsageError(
                f"{what} {name} needs the argument {absent[0]!r}, which the {split} split of the dataset does not "
                f"give (its columns: {', '.join(dataset.column_names)}): add a column {absent[0]!r}, or give the "
                "argument a default"
            )


@dataclass
class TrainerState:
    """What TRL gives reward functions as `trainer_state` (transformers' TrainerState, the fields a reward function
    reads to shape its reward over training): optimizer steps done and in all, passes over the training prompts."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: int = 0
    is_world_process_zero: bool = field(default_factory=lambda: get_rank() == 0)
    is_local_process_zero: bool = field(default_factory=lambda: int(os.environ.get("LOCAL_RANK", 0)) == 0)


class RewardLogs:
    """TRL's `log_extra` and `log_metric`, which reward functions are given: extra columns of the training
    completions table (--log_completions), and metrics, each the mean of what the update's calls logged. A function's
    metric is logged as `log_metric/<name>`, so that it never passes for (or replaces) one the run logs itself (TRL
    would average a `reward` it logged with the run's own); a column named as one of the table's own is renamed
    `log_extra/<name>` (completion_rows)."""

    def __init__(self):
        self.columns, self.metrics = defaultdict(list), defaultdict(list)

    def log_extra(self, column: str, values: list) -> None:
        self.columns[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))

    def keep_rows(self, rows: list[int], num_scored: int) -> None:
        """Only these rows of the columns logged since the last take, of num_scored rows scored (--dynamic_sampling:
        the rows an update keeps of every round's); a column of another length is left for take() to report."""
        for name, values in self.columns.items():
            if len(values) == num_scored:
                self.columns[name] = [values[i] for i in rows]

    def take(self, num_rows: int) -> tuple[dict[str, list], dict[str, float]]:
        """The columns and the metrics logged since the last take, over every process (rank order, as the batch is
        gathered; None in the rows of a process that gave no such column); then empty."""
        mine = (dict(self.columns), dict(self.metrics), num_rows)
        everyone = [mine]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        self.clear()
        for c, _, n in everyone:
            for name, values in c.items():
                if len(values) != n:
                    raise RunError(
                        f"a reward function's log_extra({name!r}, values) gave {len(values)} values for {n} "
                        "completions: one value per completion, once per call"
                    )
        columns = {
            name: [v for c, _, n in everyone for v in c.get(name, [None] * n)]
            for name in sorted({name for c, _, _ in everyone for name in c})
        }
        metrics = {}
        for name in sorted({name for _, m, _ in everyone for name in m}):
            values = [v for _, m, _ in everyone for v in m.get(name, [])]
            metrics[f"log_metric/{name}"] = sum(values) / len(values)
        return columns, metrics

    def clear(self) -> None:
        self.columns.clear()
        self.metrics.clear()


@functools.cache
def reward_event_loop() -> asyncio.AbstractEventLoop:
    """One event loop for every call of the async reward functions and tools, run in a thread of its own: a client they
    keep (an HTTP session) stays bound to the loop it was made on, so a fresh loop per update (or per thread) would
    break it; the training thread and the rollout queue's submit to it alike, and neither waits for the other's."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="reward event loop", daemon=True).start()
    return loop


def await_all(awaitables: list) -> list:
    """Their results (or the exceptions they raised), awaited concurrently on the reward functions' event loop."""

    async def settle(awaitable):
        try:
            return await awaitable
        except (Exception, SystemExit) as e:  # (gather's return_exceptions lets a SystemExit end the process)
            return e

    async def gather():
        return await asyncio.gather(*(settle(a) for a in awaitables))

    return asyncio.run_coroutine_threadsafe(gather(), reward_event_loop()).result()


def call_reward_funcs(
    funcs: list[Callable],
    names: list[str],
    batch_size: int,
    timeout: Optional[float],
    check: Optional[Callable] = None,
    /,
    **kwargs,
) -> list:
    """Call each TRL-style reward function with the same keyword arguments (TRL 1.16's: prompts, completions,
    completion_ids, the dataset's other columns, trainer_state, log_extra, log_metric); the async ones run concurrently,
    as in TRL. Returns each one's (B,) rewards, checked, NaN where it returned None (or what `check` makes of its
    values: an evaluation metric function's). timeout (--reward_timeout): the seconds each plain function, and the async
    ones together, may take; None: no limit."""
    results = []
    for func, name in zip(funcs, names):
        try:  # an async function gives its coroutine, awaited below with the others
            results.append(within(timeout, f"reward function {name}", func, **kwargs))
        except RewardTimeout:
            raise
        except (Exception, SystemExit) as e:  # it must not end the run quietly: check_reward_values names it
            results.append(e)
    pending = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
    if pending:
        awaited = within(
            timeout,
            "async reward functions " + ", ".join(names[i] for i in pending),
            await_all,
            [results[i] for i in pending],
        )
        for i, value in zip(pending, awaited):
            results[i] = value
    return [(check or check_reward_values)(values, name, batch_size) for values, name in zip(results, names)]


class RewardTimeout(RunError):
    """A reward function past --reward_timeout (an HTTP judge that hangs): the run stops, keeping its checkpoint."""


def within(timeout: Optional[float], what: str, func: Callable, *args, **kwargs):
    """func(*args, **kwargs), in this thread when timeout is None; else in a daemon thread given `timeout` seconds,
    after which RewardTimeout is raised and the thread left behind (Python cannot stop it; it ends with the process).
    Waiting on it, this thread still takes Ctrl-C and SIGTERM."""
    if timeout is None:
        return func(*args, **kwargs)
    outcome = {}

    def call():
        try:
            outcome["value"] = func(*args, **kwargs)
        except BaseException as e:  # re-raised in the calling thread
            outcome["error"] = e

    worker = threading.Thread(target=call, name=what, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardTimeout(f"{what} did not return within --reward_timeout {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def check_reward_values(values, name: str, batch_size: int, what: str = "reward function") -> torch.Tensor:
    """What a reward function (`what`) returned (or raised, awaited) as (B,) floats, NaN for None; else a one-line
    error."""
    if isinstance(values, SystemExit):
        raise UsageError(f"{what} {name} called sys.exit({values.code!r})")
    if isinstance(values, BaseException):
        raise UsageError(f"{what} {name} raised {describe(values)}")
    if torch.is_tensor(values) or isinstance(values, np.ndarray):
        values = values.tolist() if values.ndim == 1 else values
    if not isinstance(values, (list, tuple)) or len(values) != batch_size:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise UsageError(f"{what} {name} must return a list of {batch_size} floats (or None), got {got}")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)  # "does not apply": ignored by the baseline
            continue
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float, np.number))
            and not (torch.is_tensor(v) and v.numel() == 1)
        ):
            raise UsageError(
                f"{what} {name} returned {v!r:.60} (a {type(v).__name__}) at index {i}; "
                "return floats, or None for 'not applicable'"
            )
        try:
            v = float(v)
        except OverflowError:
            raise UsageError(f"{what} {name} returned an int too large for a float at index {i}") from None
        if not math.isfinite(v):
            raise UsageError(f"{what} {name} returned {v} at index {i}; return None for 'not applicable'")
        if abs(v) > FLOAT32_MAX:
            raise UsageError(
                f"{what} {name} returned {v:.3g} at index {i}, past the float32 range of the "
                f"rewards (+-{FLOAT32_MAX:.3g}): scale its values down"
            )
        out.append(v)
    return torch.tensor(out, dtype=torch.float32)


FLOAT32_MAX, FLOAT32_TINY = torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny


def check_reward_range(scores: torch.Tensor, update: int) -> None:
    """(B,) rewards (NaN: not scored) whose sums or squares overflow float32 would end as inf advantages, every step
    skipped, or, divided by an overflowed std, as advantages of 0 that train nothing: one line instead, at the update
    that meets them (the checkpoint of the one before is kept)."""
    scored = scores[~scores.isnan()].float()
    sums = scored.abs().sum()  # bounds every sum of the baselines and means
    squares = (scored - scored.mean()).square().sum() if sums.isfinite() else sums  # bounds every std's, group or batch
    if scored.isfinite().all() and sums.isfinite() and squares.isfinite():
        return
    raise RunError(
        f"the rewards of update {update} reach {scored.abs().max():.3g}, too large for float32 "
        "once summed or squared (the baselines, the std of --normalize_reward and of group normalisation): "
        "scale them down (a reward function's values, --reward_weights)"
    )


@functools.cache
def vader_analyzer():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()  # reads its lexicon: built once


def vader_sentiment(completions, **kwargs) -> list[float]:
    """VADER compound sentiment of the completion, in [-1, 1] (Hutto & Gilbert 2014; a lexicon, no download)."""
    return [vader_analyzer().polarity_scores(message_text(c))["compound"] for c in completions]


def completion_length(completion_ids, **kwargs) -> list[float]:
    """Number of completion tokens: a simple signal to check that learning works."""
    return [float(len(ids)) for ids in completion_ids]


def soft_overlong_punishment(
    completion_ids, max_completion_length: int, buffer_length: int, penalty_factor: float = 1.0, **kwargs
) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to max_completion_length - buffer_length tokens,
    then falling linearly to -penalty_factor at max_completion_length, the length of a truncated completion. Where
    --mask_truncated_completions takes the truncated completions out of the loss, this also shapes the ones that end
    close to the limit (docs/verifiable.md)."""
    start = max_completion_length - buffer_length
    return [-penalty_factor * min(max(len(ids) - start, 0) / buffer_length, 1.0) for ids in completion_ids]


# with the verifiable rewards of tasks with a right answer: answer_accuracy, gsm8k_accuracy, number_only
BUILTIN_REWARD_FUNCS = {
    "vader_sentiment": vader_sentiment,
    "completion_length": completion_length,
    "soft_overlong_punishment": soft_overlong_punishment,  # its lengths from the options: builtin_reward_funcs
    **VERIFIABLE_REWARD_FUNCS,
}


def builtin_reward_funcs(
    *, max_completion_length: int, overlong_buffer_length: Optional[int], overlong_penalty_factor: float
) -> dict[str, Callable]:
    """The built-in reward functions by name, those with parameters given theirs: soft_overlong_punishment's limit
    (--max_completion_length), the tokens before it over which its penalty grows (--overlong_buffer_length; None: a
    fifth of the limit) and its penalty at the limit (--overlong_penalty_factor)."""
    buffer_length = overlong_buffer_length or max(1, max_completion_length // 5)
    overlong = functools.partial(
        soft_overlong_punishment,
        max_completion_length=max_completion_length,
        buffer_length=buffer_length,
        penalty_factor=overlong_penalty_factor,
    )
    return {**BUILTIN_REWARD_FUNCS, "soft_overlong_punishment": overlong}


@torch.no_grad()
def reward_model_scores(reward_model, input_ids, attention_mask, packing: Optional[str] = None) -> torch.Tensor:
    """(B,) scores: the value head read at the last real token, which for a completion that ended is its EOS, as in
    "The N+ implementation details of RLHF with PPO" (found by the mask: the padding token may equal EOS).
    Padding-free with `packing` (pack_sequences), as completion_logprobs."""
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    last = last_true_index(attention_mask)  # (B,)
    if packing:
        ids, positions, index = pack_sequences(input_ids, attention_mask, packing)
        hidden = backbone(
            input_ids=ids, position_ids=positions, use_cache=False, **varlen_kwargs(attention_mask, packing)
        ).last_hidden_state.flatten(0, 1)
        return reward_model.score(hidden[index[torch.arange(len(last)), last]]).squeeze(-1).float()
    hidden = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from(attention_mask),
        use_cache=False,
    ).last_hidden_state
    return reward_model.score(hidden[torch.arange(len(last)), last]).squeeze(-1).float()


def weighted_reward(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(B, F) -> (B,): NaN-aware weighted sum; a row where every source returned None stays NaN."""
    total = torch.nansum(rewards_per_func * weights, dim=1)
    return torch.where(rewards_per_func.isnan().all(1), torch.nan, total)


def task_scores(rewards_per_func, weights, ended, missing_eos_penalty: Optional[float]) -> torch.Tensor:
    """(B,) each completion's score: the sources' weighted sum (NaN-aware), less --missing_eos_penalty where the
    completion did not end (old TRL's EOS trick); before the batch's normalisation and the KL penalty."""
    scores = weighted_reward(rewards_per_func, weights)
    if missing_eos_penalty is not None:
        scores = torch.where(ended, scores, scores - missing_eos_penalty)
    return scores


def clip_bounds(reward_clip_range: list[float]) -> tuple[float, float]:
    """--reward_clip_range as (lo, hi): one number c is [-c, c], two are [lo, hi]."""
    if len(reward_clip_range) == 1:
        return -abs(reward_clip_range[0]), abs(reward_clip_range[0])
    return reward_clip_range[0], reward_clip_range[1]


def group_std(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(B,) unbiased std of the scorable rewards of each row's group."""
    r = rewards.view(-1, num_generations)  # (num_prompts, G)
    n = (~r.isnan()).sum(1, keepdim=True)
    variance = (r - r.nanmean(1, keepdim=True)).square().nansum(1, keepdim=True) / (n - 1).clamp(min=1)
    return variance.sqrt().expand_as(r).reshape(-1)


class Scorer:
    """A rollout's rewards, (B, F) by every source: the reward model first, then the reward functions (NaN where one
    returned None). The functions get what TRL gives them (prompts, completions, completion_ids, the dataset's columns,
    trainer_state, log_extra and log_metric; in multi-turn rollouts the conversations and environments)."""

    def __init__(
        self,
        *,
        tokenizer,
        reward_tokenizer,
        reward_model: Optional[torch.nn.Module],
        reward_funcs: list[Callable],
        reward_names: list[str],
        reward_weights: torch.Tensor,
        tool_use,
        trainer_state: TrainerState,
        device: torch.device,
        autocast: Callable,
        console,
        padding_free: bool,
        local_rollout_forward_batch_size: int,
        chat_template_kwargs: Optional[dict],
        reward_timeout: Optional[float],
    ):
        """tokenizer: the policy's, which decodes the completions; reward_tokenizer: a reward model's own (None: it
        reads the policy's token ids); reward_model: None where none scores; reward_funcs: the reward functions (after
        the reward model); reward_names: (F,) every source's name, the reward model first; reward_weights: (F,) theirs
        (--reward_weights); tool_use: a multi-turn rollout's tools and environments (set_up.RunPlan's; None: single
        turn), to which a scored rollout gives its environments back; trainer_state: what the functions get as TRL's
        trainer_state; autocast(): the reward model's forwards under --bf16; console: where a fallback is said;
        padding_free (--padding_free): a reward model's forwards without padding where it allows;
        local_rollout_forward_batch_size: the rows of one of its forwards; chat_template_kwargs: the reward tokenizer's
        chat template's own arguments (--chat_template_kwargs); reward_timeout: the seconds a function may take
        (--reward_timeout; None: no limit)."""
        self.tokenizer, self.reward_tokenizer, self.reward_model = tokenizer, reward_tokenizer, reward_model
        self.funcs, self.names = reward_funcs, reward_names
        self.weights = reward_weights.to(device)  # (F,) --reward_weights
        self.trainer_state, self.device, self.autocast = trainer_state, device, autocast
        self.forward_batch_size, self.chat_template_kwargs = local_rollout_forward_batch_size, chat_template_kwargs
        self.timeout = reward_timeout
        backbone = self.reward_model and getattr(self.reward_model, self.reward_model.base_model_prefix)
        self.packing = packing_layout(backbone, padding_free, False, console, "reward model", autocast)
        self.logs = RewardLogs()  # what the functions log (log_extra, log_metric)
        self.tool_use = tool_use  # a rollout made ahead gives its environments back once scored

    def score(self, rollout) -> tuple[torch.Tensor, list[str]]:
        """(B, F) rewards of every source, and the decoded completions."""
        texts = self.tokenizer.batch_decode(
            rollout.completion_ids * rollout.completion_mask
            + self.tokenizer.pad_token_id * (1 - rollout.completion_mask),
            skip_special_tokens=True,
        )
        per_source = [] if self.reward_model is None else [self.model_scores(rollout, texts)]
        per_source += self.call(self.funcs, self.names[len(per_source) :], rollout, texts)
        if rollout.turns is not None:
            self.tool_use.release(rollout.turns)
        return torch.stack(per_source, 1).to(self.device), texts

    def model_scores(self, rollout, texts: list[str]) -> torch.Tensor:
        """(B,) the reward model's scores, in chunks: of the policy's token ids, or (a reward model with a tokenizer of
        its own) of the prompts and completions as text again."""
        chunk = self.forward_batch_size
        if self.reward_tokenizer is None:  # it reads the policy's own token ids
            input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
            attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
        else:
            input_ids, attention_mask = (
                t.to(self.device)
                for t in reward_model_inputs(
                    self.reward_tokenizer, rollout.prompts, texts, rollout.ended, self.chat_template_kwargs
                )
            )
        with self.autocast():
            scores = torch.cat(
                [
                    reward_model_scores(
                        self.reward_model, input_ids[i : i + chunk], attention_mask[i : i + chunk], self.packing
                    )
                    for i in range(0, len(input_ids), chunk)
                ]
            ).cpu()
        bad = (~scores.isfinite()).nonzero()
        if len(bad):
            raise RunError(
                f"reward model {self.names[0]} gave a non-finite score ({scores[bad[0, 0]]}) at index "
                f"{int(bad[0, 0])}: check its weights, or leave out --bf16"
            )
        return scores

    def call(self, funcs, names, rollout, texts: list[str], check=None) -> list[torch.Tensor]:
        """Each function's (B,) values on the rollout (call_reward_funcs: NaN for None, one line for a failure)."""
        turns = rollout.turns
        return call_reward_funcs(
            funcs,
            names,
            len(texts),
            self.timeout,
            check,
            **reward_func_arguments(
                rollout.prompts, texts, rollout.completion_ids, rollout.completion_mask, turns and turns.messages
            ),
            **({"environments": turns.environments, "environment_rewards": turns.rewards} if turns else {}),
            trainer_state=self.trainer_state,
            log_extra=self.logs.log_extra,
            log_metric=self.logs.log_metric,
            **rollout.columns,
        )
