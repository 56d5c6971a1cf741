"""Multi-turn rollouts made ahead (--max_staleness with --tools or --environment): the whole rollout made in the rollout
queue's thread equal to the one the training thread makes, environments owned by their rollout until it is scored, one
rollout's tools at a time, a hung tool bounded by --tool_timeout, what a checkpoint keeps of them, and a rollout too old
when its update takes it sampled again. End to end on a vLLM server: tests/test_tools.py (the vault runs)."""

import asyncio
import io
import threading
import time
import types

import pytest
import torch

from rloo_utils.rollout_queue import RolloutQueue
from rloo_utils.rollouts import BaseSampler, Rollout
from rloo_utils.tools import ToolUse, call_tools, load_environments, load_tools
from conftest import WAIT
from test_tools import ids_of, tool_tokenizer, tools_file  # noqa: F401 (fixtures)

CALL = '<tool_call>{"name": "open_vault", "arguments": {}}</tool_call><|im_end|>'
CALL_SECRET = '<tool_call>{"name": "secret", "arguments": {"name": "ann"}}</tool_call><|im_end|>'


class ScriptedSampler(BaseSampler):
    """A sampler whose model turns are scripted: a row whose first-turn seed is even calls the tool, an odd one answers;
    after a tool's result every row answers. Each turn takes `delay` seconds and records the thread it ran in."""

    def __init__(self, tokenizer, tool_use, call: str = CALL, delay: float = 0.0):
        models = types.SimpleNamespace(tokenizer=tokenizer, processor=None)
        plan = types.SimpleNamespace(tool_use=tool_use, image_column=None)
        eos = tokenizer.eos_token_id
        lengths = dict(max_prompt_length=64, max_completion_length=256, chat_template_kwargs=None)
        super().__init__(models, plan, [eos], [eos], torch.device("cpu"), **lengths, max_staleness=1)
        self.call, self.delay, self.threads = call, delay, []

    def generate_turn(self, contexts, budgets, config, seeds=None):
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay)
        turns = []
        for context, budget, seed in zip(contexts, budgets, seeds):
            answered = "tool_response" in self.tokenizer.decode(context)
            text = "done<|im_end|>" if answered or seed % 2 else self.call
            ids = ids_of(self.tokenizer, text)[:budget]
            turns.append((ids, [-0.5] * len(ids)))
        return turns


def vault_request(update: int) -> dict:
    words = ["good", "bad", "fine", "sad"]
    return {
        "prompts": [[{"role": "user", "content": f"open it {update}"}]] * 4,
        "columns": {"secret_word": [words[(update + i) % 4] for i in range(4)]},
        "config": None,
        "seeds": [10 * update + i for i in range(4)],
    }


def vault_tool_use(path: str) -> ToolUse:
    pool = load_environments([f"{path}:Vault"])
    return ToolUse([], {name: type(p[0]) for name, p in pool.items()}, pool, max_tool_calling_iterations=2)


def same_rollout(a: Rollout, b: Rollout) -> None:
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "ended"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.sampling_logprobs, b.sampling_logprobs)
    assert a.turns.messages == b.turns.messages and a.turns.prompts == b.turns.prompts
    assert (a.turns.calls, a.turns.failures) == (b.turns.calls, b.turns.failures)


def test_a_multi_turn_rollout_made_in_the_queues_thread_is_the_one_the_training_thread_makes(
    tool_tokenizer,  # noqa: F811
    tools_file,  # noqa: F811
):
    """With --max_staleness 1 the rollouts of updates 1 and 2 are made whole in the queue's thread (environments
    reset, turns, tool calls), each environment its rollout's own: the rewards read from them are each row's."""
    made_ahead = ScriptedSampler(tool_tokenizer, vault_tool_use(tools_file))
    queue = RolloutQueue(1, 3, made_ahead.background_rollout, timeout=WAIT)
    queue.start(0, vault_request)
    first, second = (made_ahead.sample(None, None, None, outputs=queue.take(u).outputs) for u in (1, 2))
    assert set(made_ahead.threads) == {"rollouts"}  # every turn in the queue's thread

    in_step = ScriptedSampler(tool_tokenizer, vault_tool_use(tools_file))
    for update, rollout in [(1, first), (2, second)]:
        request = vault_request(update)
        expected = in_step.sample(request["prompts"], request["columns"], None, request["seeds"])
        same_rollout(rollout, expected)
        assert rollout.turns.calls == 2  # the even seeds' rows called the vault, read its word and answered
        assert [len(m) for m in rollout.turns.messages] == [3, 1, 3, 1] and rollout.tool_mask[[0, 2]].sum() > 0
        # each row's environment was reset with its row and opened by its own calls only
        assert [e.secret_word for e in rollout.turns.environments] == request["columns"]["secret_word"]
        assert [e.opened for e in rollout.turns.environments] == [1, 0, 1, 0]
        assert rollout.turns.rewards == {"Vault": [1.0, 0.0, 1.0, 0.0]}  # get_reward, read as the rollout ended
    assert set(in_step.threads) == {"MainThread"}
    # the two rollouts in flight own their environments: none shared, none the training thread's pool
    owned = [id(e) for r in (first, second) for e in r.turns.environments]
    assert len(set(owned)) == 8 and not set(owned) & {id(e) for e in made_ahead.tool_use.pool["Vault"]}


def test_a_rollout_made_ahead_keeps_its_environments_until_it_is_scored(tool_tokenizer, tools_file):  # noqa: F811
    """The rollout of update 2 is made while update 1's is still unscored: it takes new instances; once update 1's is
    scored (released), the next rollout made ahead takes those, row by row."""
    sampler = ScriptedSampler(tool_tokenizer, vault_tool_use(tools_file))
    tool_use = sampler.tool_use
    first = sampler.background_rollout(vault_request(1))
    second = sampler.background_rollout(vault_request(2))
    assert not {id(e) for e in first.turns.environments} & {id(e) for e in second.turns.environments}
    assert [e.secret_word for e in first.turns.environments] == vault_request(1)["columns"]["secret_word"]  # intact
    tool_use.release(first.turns)
    tool_use.release(first.turns)  # given back once only
    third = sampler.background_rollout(vault_request(3))
    assert [id(e) for e in third.turns.environments] == [id(e) for e in first.turns.environments]
    assert tool_use.free["Vault"] == []


def test_one_multi_turn_rollout_at_a_time_calls_the_tools(tool_tokenizer, tools_file):  # noqa: F811
    """An evaluation's rollout in the training thread while the queue's thread makes the next update's: their tools are
    never called at once (the sampler's lock), so a tool need not be thread-safe."""
    active, most = [0], [0]

    def open_vault() -> str:
        """Opens the vault."""
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.02)
        active[0] -= 1
        return "good"

    sampler = ScriptedSampler(tool_tokenizer, ToolUse([open_vault], {}, {}, max_tool_calling_iterations=2), delay=0.01)
    queue = RolloutQueue(1, 3, sampler.background_rollout, timeout=WAIT)
    queue.start(0, vault_request)  # updates 1 and 2, in the queue's thread
    for update in (5, 6, 7):  # meanwhile, in this thread
        request = vault_request(update)
        sampler.sample(request["prompts"], request["columns"], None, request["seeds"])
    queue.take(1), queue.take(2)
    assert "rollouts" in sampler.threads and "MainThread" in sampler.threads
    assert most == [1]


def hang(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


async def hang_async(seconds: float) -> str:
    """Sleeps, asynchronously.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "awake"


@pytest.mark.parametrize("tool", [hang, hang_async])
def test_a_hung_tool_is_answered_with_an_error_after_the_timeout_and_said_in_one_line(tool, capsys):
    calls = [{"type": "function", "function": {"name": tool.__name__, "arguments": {"seconds": 30}}}]
    start = time.perf_counter()
    messages, failures, timeouts = call_tools(calls, {tool.__name__: tool}, timeout=0.2)
    assert time.perf_counter() - start < 5
    assert failures == timeouts == 1 and messages[0]["content"] == str(
        {"error": "the tool did not return within 0.2 s"}
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"tool {tool.__name__} did not return within --tool_timeout 0.2 s: answered with an error"]
    # within the bound it answers as always
    calls[0]["function"]["arguments"]["seconds"] = 0
    assert call_tools(calls, {tool.__name__: tool}, timeout=5) == (
        [{"role": "tool", "name": tool.__name__, "content": "awake"}],
        0,
        0,
    )


def times_out_itself(url: str) -> str:
    """Fetches, and times out on its own.

    Args:
        url: what
    """
    raise TimeoutError(f"{url} timed out")


@pytest.mark.parametrize("timeout", [None, 5])
def test_a_tools_own_timeout_error_is_its_failure_not_the_bound(timeout, capsys):
    """A TimeoutError the tool raises itself (a socket's) is a failing call, with or without --tool_timeout."""
    calls = [{"type": "function", "function": {"name": "times_out_itself", "arguments": {"url": "x"}}}]
    messages, failures, timeouts = call_tools(calls, {"times_out_itself": times_out_itself}, timeout)
    assert (failures, timeouts) == (1, 0) and messages[0]["content"] == str({"error": "x timed out"})
    assert capsys.readouterr().out == ""


class SlowVault:
    """An environment whose tool hangs on its first call of the run."""

    calls = 0

    def reset(self, prompt, secret_word, **row):
        self.secret_word = secret_word

    def open_vault(self) -> str:
        """Opens the vault."""
        SlowVault.calls += 1
        if SlowVault.calls == 1:
            time.sleep(3)
        return self.secret_word


def test_an_environment_whose_call_ran_past_the_timeout_is_never_used_again(tool_tokenizer, capsys):  # noqa: F811
    """The call left running may still change its environment: once its rollout is scored, neither the rollouts made
    ahead (the free instances) nor the training thread's (the pool) get that instance again."""
    pool = {"SlowVault": [SlowVault()]}
    tool_use = ToolUse([], {"SlowVault": SlowVault}, pool, max_tool_calling_iterations=2, tool_timeout=0.5)
    sampler = ScriptedSampler(tool_tokenizer, tool_use)
    made_ahead = sampler.background_rollout(vault_request(1))  # rows 0 and 2 call; row 0's call hangs
    assert made_ahead.turns.abandoned == [True, False, False, False] and "--tool_timeout 0.5" in capsys.readouterr().out
    left_running = made_ahead.turns.environments[0]
    tool_use.release(made_ahead.turns)
    assert left_running not in tool_use.free["SlowVault"] and len(tool_use.free["SlowVault"]) == 3
    SlowVault.calls = 0
    request = vault_request(2)
    in_step = sampler.sample(request["prompts"], request["columns"], None, request["seeds"])
    left_running = in_step.turns.environments[0]
    tool_use.release(in_step.turns)
    assert left_running not in tool_use.pool["SlowVault"] and len(tool_use.pool["SlowVault"]) == 4
    assert tool_use.pool["SlowVault"][1] is in_step.turns.environments[1]  # the others stay


def test_a_checkpoint_keeps_a_multi_turn_rollout_whole_and_leaves_out_one_with_environments(
    tool_tokenizer,  # noqa: F811
    tools_file,  # noqa: F811
    capsys,
):
    """--tools only: the finished rollout of older weights is kept (tensors, and its conversations as JSON, which
    torch.load takes with weights_only) and a resumed queue trains on it as it was. With environments (the user's
    objects) it is left out, said in one line, and sampled again from the checkpoint's weights."""
    sampler = ScriptedSampler(
        tool_tokenizer,
        ToolUse(load_tools([f"{tools_file}:secret"]), {}, {}, max_tool_calling_iterations=2),
        CALL_SECRET,
    )
    queue = RolloutQueue(2, 6, sampler.background_rollout, timeout=WAIT)
    queue.start(0, vault_request)
    made = {u: queue.pending[u] for u in (1, 2, 3)}
    queue.take(1), queue.before_push(), queue.pushed(1)
    buffer = io.BytesIO()
    torch.save(queue.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert sorted(state["per_process"][0]["kept"]) == [2, 3] and state["per_process"][0]["left_out"] == []
    resumed = RolloutQueue(2, 6, sampler.background_rollout, timeout=WAIT)
    resumed.load_state_dict(state)
    resumed.start(1, vault_request)
    for update in (2, 3):
        taken = resumed.take(update)
        assert taken.version == 0 and not taken.resampled
        rollout = sampler.sample(None, None, None, outputs=taken.outputs)
        same_rollout(rollout, made[update].outputs)
        assert rollout.turns.calls == 2 and rollout.columns == made[update].outputs.columns

    sampler = ScriptedSampler(tool_tokenizer, vault_tool_use(tools_file))
    queue = RolloutQueue(2, 6, sampler.background_rollout, timeout=WAIT)
    queue.start(0, vault_request)
    queue.take(1), queue.before_push(), queue.pushed(1)
    state = queue.state_dict()
    assert state["per_process"][0] == {"kept": {}, "left_out": [2, 3]}
    resumed = RolloutQueue(2, 6, sampler.background_rollout, timeout=WAIT)
    resumed.load_state_dict(state)
    assert "could not keep the multi-turn rollouts of updates [2, 3]" in capsys.readouterr().out
    resumed.start(1, vault_request)
    assert resumed.take(2).version == 1  # the checkpoint's weights


def test_the_training_threads_turns_keep_in_step_with_the_other_processes_and_the_queues_thread_does_not(
    tool_tokenizer,  # noqa: F811
    tools_file,  # noqa: F811
    monkeypatch,
):
    """rloo_multigpu.py: in the training thread every process makes every turn (each turn's agreed() is a collective,
    and with HF generate its forward), so this process makes two more turns for another still going; in the queue's
    thread, which holds no collective, a process makes its own turns only."""
    import rloo_utils.tools

    others = iter([True, True, False] * 2)  # another process: two turns more than this one
    monkeypatch.setattr(rloo_utils.tools, "any_process", lambda going_on: going_on or next(others))
    sampler = ScriptedSampler(tool_tokenizer, vault_tool_use(tools_file))
    request = vault_request(1)
    sampler.sample(request["prompts"], request["columns"], None, request["seeds"])
    assert len(sampler.threads) == 2 + 2  # its own two (a call, the answer), and two for the other process
    sampler.threads.clear()
    sampler.background_rollout(request)
    assert len(sampler.threads) == 2
