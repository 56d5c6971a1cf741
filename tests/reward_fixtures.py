"""Reward functions the end-to-end tests pass as `tests/reward_fixtures.py:NAME`, TRL-style."""

import asyncio
import functools
import gc
import math
import os
import sys
import time

import torch


def _text(completion):
    return completion if isinstance(completion, str) else completion[-1]["content"]


def count_good(completions, **kwargs):
    """How often the word "good" appears: a reward the tiny random model can learn to raise quickly."""
    return [float(_text(c).split().count("good")) for c in completions]


def count_symbols(completions, **kwargs):
    """How many of the completion's characters are ASCII digits or punctuation, "!" to "@": a dense reward for the
    tiny model, whose tokenizer has one token for each of these 32 characters among its 512 (a random policy writes
    about 0.4 of them in 8 tokens, and the completions of a group differ), so that it rises on every seed within a dozen
    updates, where count_good's one token in 512 rises on some seeds only (docs/tests.md, "Learning tests")."""
    return [float(sum("!" <= ch <= "@" for ch in _text(c))) for c in completions]


def says_good(completions, **kwargs):
    """An evaluation metric that is a success test: whether the completion says "good"."""
    return ["good" in _text(c).split() for c in completions]


def short_is_better(completion_ids, **kwargs):
    return [-len(ids) / 10 for ids in completion_ids]


def only_topic_a(completions, topic, **kwargs):
    """A multi-task reward: scores rows of topic "a" and says None (not applicable) for the others."""
    return [float(len(_text(c))) if t == "a" else None for c, t in zip(completions, topic)]


def records_kwargs(prompts, completions, completion_ids, **kwargs):
    """Checks the TRL calling convention and that every dataset column arrives, then returns zeros."""
    assert len(prompts) == len(completions) == len(completion_ids)
    assert "topic" in kwargs and len(kwargs["topic"]) == len(prompts), sorted(kwargs)
    assert all(isinstance(i, int) for ids in completion_ids for i in ids)
    return [0.0] * len(prompts)


def raises(completions, **kwargs):
    raise RuntimeError("the judge is down")


def wrong_count(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def returns_nan(completions, **kwargs):
    return [math.nan] * len(completions)


def returns_string(completions, **kwargs):
    return ["high"] * len(completions)


def always_none(completions, **kwargs):
    return [None] * len(completions)


def huge(completions, **kwargs):
    """Finite rewards whose squares overflow float32 (the std of a group): the run must stop with one line."""
    return [3e38 if i % 4 == 0 else 0.0 for i in range(len(completions))]


def huge_from_the_second_update(completions, trainer_state, **kwargs):
    """Rewards of 1e30 from the second update on: the grpo std of a group overflows, which would zero the advantages."""
    scale = 1e30 if trainer_state.global_step > 0 else 1.0
    return [scale * len(_text(c)) for c in completions]


def poisons_gradients(completions, **kwargs):
    """Ordinary rewards; on its first call it puts inf into every gradient of the policy (hooks on its trainable
    weights), a stand-in for a backward that overflows: every optimizer step must be skipped."""
    global POISONED
    if not POISONED:
        models = [m for m in gc.get_objects() if isinstance(m, torch.nn.Module) and hasattr(m, "generate")]
        for p in (p for m in models for p in m.parameters() if p.requires_grad):
            p.register_hook(lambda grad: torch.full_like(grad, math.inf))
        POISONED = True
    return [len(_text(c)) / 10 for c in completions]


POISONED = False


def text_length(completions, **kwargs):
    """Characters per completion: a reward that differs between the completions of the tiny model from the start."""
    return [len(_text(c)) / 10 for c in completions]


def slow_text_length(completions, **kwargs):
    """Characters per completion, in a quarter of a second: a run slow enough to be killed in the middle of it."""
    time.sleep(0.25)
    return [len(_text(c)) / 10 for c in completions]


# Callables that are not plain functions: they have no __name__, so their metrics go under the name in the spec
class _LengthReward:
    def __init__(self, scale):
        self.scale = scale

    def __call__(self, completion_ids, **kwargs):
        return [self.scale * len(ids) for ids in completion_ids]


length_reward = _LengthReward(0.1)  # a callable instance (a class with __call__)


def _scaled_count_good(completions, scale, **kwargs):
    return [scale * _text(c).split().count("good") for c in completions]


half_count_good = functools.partial(_scaled_count_good, scale=0.5)


# Broken reward functions: each must end the run with a one-line error
def returns_dict(completions, **kwargs):
    return {i: 1.0 for i in range(len(completions))}


def returns_huge_int(completions, **kwargs):
    return [10**400] * len(completions)


def calls_sys_exit(completions, **kwargs):
    sys.exit(3)


_calls = {"n": 0}


def fails_on_rank_1_at_call_4(completions, **kwargs):
    """count_good, until the 4th call on the process of rank 1 (torchrun's RANK), which raises."""
    _calls["n"] += 1
    if _calls["n"] == 4 and os.environ.get("RANK") == "1":
        raise RuntimeError("the judge is down")
    return count_good(completions)


def hangs_on_rank_1_at_call_4(completions, **kwargs):
    """count_good, until the 4th call on the process of rank 1, which never returns (a judge that hangs)."""
    _calls["n"] += 1
    if _calls["n"] == 4 and os.environ.get("RANK") == "1":
        time.sleep(3600)
    return count_good(completions)


def fails_in_the_second_sample_table(completions, **kwargs):
    """count_good, until its 5th call on rank 1 (or in a run of one process), which raises: with 6 updates and sample
    tables at 0, 3 and 6, that call scores the table after update 3."""
    _calls["n"] += 1
    if _calls["n"] == 5 and os.environ.get("RANK", "1") == "1":
        raise RuntimeError("the judge is down")
    return count_good(completions)


def exits_on_rank_1(completions, **kwargs):
    """The process of rank 1 dies at the 3rd call, without a word (as a process killed by the system would)."""
    _calls["n"] += 1
    if _calls["n"] == 3 and os.environ.get("RANK") == "1":
        os._exit(int(os.environ.get("RLOO_TEST_EXIT_CODE", "1")))
    return count_good(completions)


def hangs_from_the_second_update(completions, trainer_state, **kwargs):
    """Text length, then from the second update on never returns (an HTTP judge that hangs), after writing `hanging`
    in the working folder so that a test knows when."""
    if trainer_state.global_step > 0:
        open("hanging", "w").close()
        time.sleep(3600)
    return [len(_text(c)) / 10 for c in completions]


async def async_hangs_from_the_second_update(completions, trainer_state, **kwargs):
    """The same, awaited: an async judge whose request never ends."""
    if trainer_state.global_step > 0:
        open("hanging", "w").close()
        await asyncio.sleep(3600)
    return [len(_text(c)) / 10 for c in completions]


def first_token_is_a_multiple_of_4(completion_ids, **kwargs):
    """1 where the completion's first token id is a multiple of 4: a 0/1 reward the tiny random model earns on about a
    quarter of its completions, so that about a third of its groups of 4 score all 0 (--dynamic_sampling drops them)."""
    return [float(bool(ids) and ids[0] % 4 == 0) for ids in completion_ids]


def first_token_is_a_multiple_of_4_logging_its_prompt(prompts, completion_ids, log_extra, **kwargs):
    """first_token_is_a_multiple_of_4, logging each row's prompt as it was scored (the completions table's
    `scored_prompt`): a test reads the rows scored beside the rows the update trained on (the table's `prompt`)."""
    log_extra("scored_prompt", list(prompts))
    return first_token_is_a_multiple_of_4(completion_ids)
