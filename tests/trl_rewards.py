"""Reward functions written as TRL 1.16's documentation writes them, for tests/test_trl_switch.py: keyword arguments
by TRL's names, `**kwargs` for the rest, `trainer_state` (transformers' TrainerState), the optional `log_extra` /
`log_metric` callbacks, and an async function. The scripts must run them unchanged."""

import asyncio

LOOPS = []  # the event loop each call of the async function ran on


def curriculum_reward(completions, trainer_state, **kwargs):
    """A reward shaped by training progress (TRL: "the trainer's state ... can be accessed by the trainer_state
    argument"): the length of the completion, weighted down as training goes on. Logs what it was given."""
    progress = trainer_state.global_step / trainer_state.max_steps
    kwargs["log_metric"]("trainer_state/global_step", trainer_state.global_step)
    kwargs["log_metric"]("trainer_state/epoch", trainer_state.epoch)
    kwargs["log_metric"]("trainer_state/max_steps", trainer_state.max_steps)
    kwargs["log_metric"]("trainer_state/is_world_process_zero", float(trainer_state.is_world_process_zero))
    return [len(completion[0]["content"]) / 100 * (1 - progress) for completion in completions]


def the_reward(completions, log_extra=None, log_metric=None, **kwargs):
    """1 for a completion that says "the"; a column of the completions table and a metric, as in TRL's docs."""
    contents = [completion[0]["content"] for completion in completions]
    says_the = ["the" in content.split() for content in contents]
    if log_extra:
        log_extra("says_the", says_the)
        log_extra("completion_again", contents)  # to check that every column lines up with its row
        log_extra("completion", ["not the completion"] * len(contents))  # the table's own columns: never replaced
        log_extra("advantage", [1e9] * len(contents))
        log_extra("step", [-1] * len(contents))  # each row's step in completions.jsonl
    if log_metric:
        log_metric("fraction_saying_the", sum(says_the) / len(says_the))
        log_metric("reward", -1e9)  # the run's own metrics: never replaced, nor averaged with it
        log_metric("episode", -1)
    return [1.0 if s else 0.0 for s in says_the]


async def async_length_reward(prompts, completions, **kwargs):
    """An async reward (e.g. a call to a judge served over HTTP), awaited by the trainer."""
    await asyncio.sleep(0.01)
    LOOPS.append(asyncio.get_running_loop())
    kwargs["log_metric"]("async/same_loop_as_first_call", float(LOOPS[-1] is LOOPS[0]))
    return [float(len(completion[0]["content"].split())) for completion in completions]
