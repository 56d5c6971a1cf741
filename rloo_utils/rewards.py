"""Reward functions: their options, loaded by name, called (async ones together) under --reward_timeout, their values
checked; the built-in ones; the task's score of a completion (the sources weighted, the EOS penalty) and the group
statistics the advantages use. The Scorer that calls them on a rollout, with a reward model: scoring.py."""

import asyncio
import functools
import importlib
import importlib.util
import inspect
import math
import os
import threading
from dataclasses import dataclass
from typing import Annotated, Callable, ClassVar, Literal, Optional

import numpy as np
import torch
import tyro

from rloo_utils.code_reward import CodeReward, code_reward
from rloo_utils.data import REWARD_FUNC_ARGUMENTS, message_text
from rloo_utils.errors import RunError, UsageError, describe
from rloo_utils.sandbox import DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT
from rloo_utils.verifiable import REWARD_FUNCS as VERIFIABLE_REWARD_FUNCS


@dataclass
class RewardSourceOptions:
    """Where the score comes from: a reward model, reward functions in TRL's signature, or both, weighted"""

    # a slow reward function, or fewer code runs at once, changes no score (options.resumable_options)
    RESUMABLE: ClassVar = {"reward_timeout", "code_workers"}

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
    code_sandbox: Literal["bwrap", "rlimits"] = "bwrap"
    """(code_reward) bwrap: bubblewrap and limits; rlimits: limits, no environment; network and files NOT protected"""
    code_timeout: float = DEFAULT_TIMEOUT
    """(code_reward) seconds one test run may take, on the wall clock and on the CPU"""
    code_memory_mb: int = DEFAULT_MEMORY_MB
    """(code_reward) the memory (address space) of one test run, in MiB"""
    code_workers: Optional[int] = None
    """(code_reward) test runs at once, in each process; None: the CPU cores, shared among torchrun's processes"""

    def check(self) -> None:
        """The reward timeout; the soft overlong punishment's options shape its reward function only, and its buffer
        fits the completion; code_reward's options shape it only, and are positive (the sources themselves are
        loaded, and checked, by reward_sources)."""
        if self.reward_timeout is not None and not self.reward_timeout > 0:
            raise UsageError(f"--reward_timeout must be > 0, got {self.reward_timeout}")
        self.check_code_options()
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

    def check_code_options(self) -> None:
        defaults = {"code_sandbox": "bwrap", "code_timeout": DEFAULT_TIMEOUT, "code_memory_mb": DEFAULT_MEMORY_MB}
        given = [
            f"--{name} {getattr(self, name)}" for name, default in defaults.items() if getattr(self, name) != default
        ]
        given += [f"--code_workers {self.code_workers}"] if self.code_workers is not None else []
        if given and "code_reward" not in (self.reward_funcs or []) + (self.eval_metric_funcs or []):
            raise UsageError(
                f"{' and '.join(given)} {'are' if len(given) > 1 else 'is'} for the reward function code_reward, "
                "which neither --reward_funcs nor --eval_metric_funcs names: add it (--reward_funcs code_reward ...), "
                "or leave the option out"
            )
        for name in ("code_timeout", "code_memory_mb", "code_workers"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UsageError(f"--{name} must be > 0, got {value}")


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
    `environments` and `environment_rewards` (multi_turn: --tools or --environment given); and one of the columns a
    function names in its `needs_one_column_of` (accuracy_reward: `solution` or `answer`, both with defaults). Else one
    line now, before the models load, rather than a TypeError at the first update. Reward functions score the training
    split, and the held-out one where the sample tables (num_sample_generations: --num_sample_generations) or the
    evaluation (eval_steps: --eval_steps) read it; metric functions the held-out split where the run evaluates."""
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
        split = "training" if dataset is train_dataset else "held-out"
        if absent:
            raise UsageError(
                f"{what} {name} needs the argument {absent[0]!r}, which the {split} split of the dataset does not "
                f"give (its columns: {', '.join(dataset.column_names)}): add a column {absent[0]!r}, or give the "
                "argument a default"
            )
        one_of = getattr(func, "needs_one_column_of", ())  # columns with defaults, of which one must be there
        if one_of and not set(one_of) & set(dataset.column_names):
            raise UsageError(
                f"{what} {name} reads a column {' or '.join(map(repr, one_of))}, which the {split} split of the "
                f"dataset does not have (its columns: {', '.join(dataset.column_names)}): add one"
            )


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
    "code_reward": code_reward,  # its sandbox's options, too
    **VERIFIABLE_REWARD_FUNCS,
}


def builtin_reward_funcs(
    *,
    max_completion_length: int,
    overlong_buffer_length: Optional[int],
    overlong_penalty_factor: float,
    code_sandbox: str = "bwrap",
    code_timeout: float = DEFAULT_TIMEOUT,
    code_memory_mb: int = DEFAULT_MEMORY_MB,
    code_workers: Optional[int] = None,
) -> dict[str, Callable]:
    """The built-in reward functions by name, those with parameters given theirs: soft_overlong_punishment's limit
    (--max_completion_length), the tokens before it over which its penalty grows (--overlong_buffer_length; None: a
    fifth of the limit) and its penalty at the limit (--overlong_penalty_factor); code_reward's sandbox
    (--code_sandbox), the seconds and memory of a test run (--code_timeout, --code_memory_mb) and how many run at once
    (--code_workers; None: the cores), which starts when the set-up checks it (check_code_reward) or at its first
    call."""
    buffer_length = overlong_buffer_length or max(1, max_completion_length // 5)
    overlong = functools.partial(
        soft_overlong_punishment,
        max_completion_length=max_completion_length,
        buffer_length=buffer_length,
        penalty_factor=overlong_penalty_factor,
    )
    code = CodeReward(code_sandbox, code_timeout, code_memory_mb, code_workers)
    return {**BUILTIN_REWARD_FUNCS, "soft_overlong_punishment": overlong, "code_reward": code}


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


def whiten_nan(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over the finite entries (unbiased std); NaN entries stay NaN (--normalize_reward)."""
    valid = x[~x.isnan()]
    if valid.numel() < 2:
        return x - valid.mean() if valid.numel() else x
    return (x - valid.mean()) / (valid.std() + eps)


def shaped_scores(
    scores: torch.Tensor, update: int, normalize: bool, clip_range: Optional[list[float]]
) -> torch.Tensor:
    """(B,) the scores as they enter the reward: checked (check_reward_range: an overflow in float32 is one line, not
    skipped steps or advantages of 0), whitened over the batch (normalize: --normalize_reward, old TRL), then clipped
    (clip_range: --reward_clip_range)."""
    check_reward_range(scores, update)
    if normalize:
        scores = whiten_nan(scores, eps=1e-8)
    if clip_range is not None:
        scores = scores.clamp(*clip_bounds(clip_range))
    return scores
