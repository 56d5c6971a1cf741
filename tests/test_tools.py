"""Multi-turn rollouts with tools and environments (rloo_utils/tools.py, docs/tools.md): the chat template's format
checked and parsed, the turns and the tools' results concatenated as ids, the mask that keeps the results out of the
loss and the KL, rollback at the length limit, failing tools, environments with get_reward, and rloo.py end to end."""

import json
import os
import re
import statistics
import sys

import pytest
import torch

from conftest import CHAT_TEMPLATE, ROOT, check_one_line_error, read_metrics, run_rloo, write_jsonl
from rloo_utils.errors import UsageError
from rloo_utils.tools import (
    ToolUse,
    check_tool_format,
    load_environments,
    load_tools,
    parse_turn,
    tool_suffix_ids,
)
from rloo_utils.logs import tool_metrics
from rloo_utils.generation import tokenize_prompts

sys.path.insert(0, os.path.join(ROOT, "benchmark"))
import tool_vault  # noqa: E402

TOOL_TEMPLATE = tool_vault.CHAT_TEMPLATE  # Hermes-style (Qwen2.5's layout, shortened): benchmark/tool_vault.py's


TOOLS_PY = '''
import asyncio


def secret(name: str) -> str:
    """The secret word of a name.

    Args:
        name: whose secret
    """
    return {"ann": "good", "bob": "bad"}[name]


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("broken on purpose")


async def slow_echo(text: str) -> str:
    """Echoes, asynchronously.

    Args:
        text: what to echo
    """
    await asyncio.sleep(0)
    return text


def undocumented(x):
    return x


def open_vault() -> str:
    """Opens the vault and reads its word (a plain tool: the same word for every row)."""
    return "good"


class Vault:
    """An environment: reset with the row, a tool that reads the row's secret, a reward for saying it."""

    def reset(self, prompt, secret_word, **row):
        self.secret_word, self.opened = secret_word, 0
        return " (the vault is locked)"

    def open_vault(self) -> str:
        """Opens the vault and reads its word."""
        self.opened += 1
        return self.secret_word

    def get_reward(self) -> float:
        return float(self.opened)
'''


@pytest.fixture(scope="module")
def tool_tokenizer(tiny):
    tokenizer = tiny["tokenizer"]
    tokenizer = type(tokenizer).from_pretrained(tiny["policy"])
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(TOOLS_PY)
    return str(path)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_template_format_is_checked_and_read_back(tool_tokenizer):
    stop = [tool_tokenizer.eos_token_id]
    check_tool_format(tool_tokenizer, stop, {}, "tiny")  # a Hermes template: accepted
    plain = type(tool_tokenizer).from_pretrained(tool_tokenizer.name_or_path)
    plain.chat_template = CHAT_TEMPLATE  # writes only each message's content: the calls are lost
    with pytest.raises(UsageError, match="drops tool calls"):
        check_tool_format(plain, stop, {}, "tiny")
    llama_like = TOOL_TEMPLATE.replace("<tool_call>", "[CALL]").replace("</tool_call>", "[/CALL]")
    with pytest.raises(UsageError, match="not in a format this project reads"):
        check_tool_format(plain, stop, {"chat_template": llama_like}, "tiny")


def test_a_turn_is_parsed_into_its_text_and_calls(tool_tokenizer):
    turn = ids_of(
        tool_tokenizer, 'hm <tool_call>{"name": "secret", "arguments": {"name": "ann"}}</tool_call><|im_end|>'
    )
    message = parse_turn(tool_tokenizer, [], turn)
    assert message == {
        "role": "assistant",
        "content": "hm",
        "tool_calls": [{"type": "function", "function": {"name": "secret", "arguments": {"name": "ann"}}}],
    }
    malformed = ids_of(tool_tokenizer, "<tool_call>{not json}</tool_call><|im_end|>")
    assert "tool_calls" not in parse_turn(tool_tokenizer, [], malformed)  # no call: text, as in TRL
    assert parse_turn(tool_tokenizer, [], ids_of(tool_tokenizer, "good<|im_end|>")) == {
        "role": "assistant",
        "content": "good",
    }


def test_the_suffix_is_what_the_template_writes_between_the_turns(tool_tokenizer):
    """prompt + turn 1 + suffix is, id for id, the template's rendering of the conversation up to the next turn."""
    stop = [tool_tokenizer.eos_token_id]
    user = [{"role": "user", "content": "the secret of ann"}]
    call = {"type": "function", "function": {"name": "secret", "arguments": {"name": "ann"}}}
    result = {"role": "tool", "name": "secret", "content": "good"}
    render = lambda messages, **kw: ids_of(
        tool_tokenizer, tool_tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    )  # noqa: E731
    prompt = render(user, add_generation_prompt=True)
    turn = ids_of(tool_tokenizer, '<tool_call>{"name": "secret", "arguments": {"name": "ann"}}</tool_call><|im_end|>')
    whole = render(
        user + [{"role": "assistant", "content": "", "tool_calls": [call]}, result], add_generation_prompt=True
    )
    assert prompt + turn + tool_suffix_ids(tool_tokenizer, [result], stop, {}) == whole


def scripted(tokenizer, turns_by_row: dict[int, list[str]]):
    """A generate_turn that answers row i's k-th turn with turns_by_row[i][k] (its ids, cut to the budget), and
    records each call's contexts and budgets."""
    calls = []

    def generate_turn(contexts, budgets, rows, round_):
        calls.append((contexts, budgets))
        out = []
        for context, budget in zip(contexts, budgets):
            row = next(i for i, c in enumerate(generate_turn.prompts) if context[: len(c)] == c)
            turn = generate_turn.done[row]
            generate_turn.done[row] += 1
            out.append((ids_of(tokenizer, turns_by_row[row][turn])[:budget], None))
        return out

    generate_turn.calls = calls
    return generate_turn


def rollout(
    tokenizer, tools, turns_by_row, prompts, max_completion_length=256, max_tool_calling_iterations=None, in_step=False
):
    use = ToolUse(tools, {}, {})
    turns = use.start(prompts, {})
    prompt_ids = [
        ids_of(tokenizer, tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True, tools=s))
        for p, s in zip(turns.prompts, turns.schemas)
    ]
    generate_turn = scripted(tokenizer, turns_by_row)
    generate_turn.prompts, generate_turn.done = prompt_ids, [0] * len(prompts)
    turns.generate(
        generate_turn,
        prompt_ids,
        tokenizer,
        [tokenizer.eos_token_id],
        max_completion_length=max_completion_length,
        max_tool_calling_iterations=max_tool_calling_iterations,
        tool_timeout=None,
        chat_template_kwargs=None,
        in_step=in_step,
    )
    return turns, prompt_ids, generate_turn


CALL_ANN = '<tool_call>{"name": "secret", "arguments": {"name": "ann"}}</tool_call><|im_end|>'


def test_a_two_turn_rollout_masks_the_tool_result_and_nothing_else(tool_tokenizer, tools_file):
    """The hand-built case of docs/tools.md: turn 1 calls a tool, its result is appended as the template renders it
    (mask 1), turn 2 answers; ids are the turns' as generated and the result's as rendered, never re-tokenised."""
    tools = load_tools([f"{tools_file}:secret"])
    prompts = [[{"role": "user", "content": "the secret of ann"}], [{"role": "user", "content": "say it"}]]
    turns, prompt_ids, _ = rollout(
        tool_tokenizer, tools, {0: [CALL_ANN, "good<|im_end|>"], 1: ["bad<|im_end|>"]}, prompts
    )
    stop = [tool_tokenizer.eos_token_id]
    result = {"role": "tool", "name": "secret", "content": "good"}
    first, second = ids_of(tool_tokenizer, CALL_ANN), ids_of(tool_tokenizer, "good<|im_end|>")
    suffix = tool_suffix_ids(tool_tokenizer, [result], stop, {})
    assert turns.ids[0] == first + suffix + second
    assert turns.tool_mask[0] == [0] * len(first) + [1] * len(suffix) + [0] * len(second)
    assert turns.ids[1] == ids_of(tool_tokenizer, "bad<|im_end|>") and not any(turns.tool_mask[1])
    assert turns.messages[0] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "secret", "arguments": {"name": "ann"}}}],
        },
        result,
        {"role": "assistant", "content": "good"},
    ]
    assert turns.ended == [True, True] and (turns.calls, turns.failures) == (1, 0)
    assert tool_metrics(turns.calls, turns.failures, len(turns.ids)) == {
        "tools/call_frequency": 0.5,
        "tools/failure_frequency": 0.0,
    }
    ids, completion_mask, tool_mask, ended, sampling_logprobs = turns.tensors(tool_tokenizer.pad_token_id, "cpu")
    assert ids.shape == (2, 256) and completion_mask[0].sum() == len(turns.ids[0])
    assert tool_mask[0].sum() == len(suffix) and tool_mask[1].sum() == 0 and ended.all()
    assert sampling_logprobs is None  # HF generate's turns give none (no vLLM correction, no sampler metrics)
    # the tools' schemas reached the prompt: the model was shown the tool it called
    assert '"name": "secret"' in tool_tokenizer.decode(prompt_ids[0])


def test_failing_and_unknown_tools_answer_with_their_error(tool_tokenizer, tools_file):
    tools = load_tools([f"{tools_file}:broken", f"{tools_file}:slow_echo"])
    calls = (
        '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "nowhere", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "slow_echo", "arguments": {"text": "hi"}}</tool_call><|im_end|>'
    )
    turns, _, _ = rollout(
        tool_tokenizer, tools, {0: [calls, "ok<|im_end|>"]}, [[{"role": "user", "content": "go"}]], 1024
    )
    results = turns.messages[0][1:4]
    assert [m["content"] for m in results] == [
        "{'error': 'broken on purpose'}",
        "{'error': 'Tool nowhere not found.'}",
        "hi",
    ]
    assert (turns.calls, turns.failures) == (3, 2)
    assert tool_metrics(turns.calls, turns.failures, len(turns.ids))["tools/failure_frequency"] == pytest.approx(2 / 3)


def test_a_result_that_would_overflow_is_rolled_back(tool_tokenizer, tools_file):
    """The results would leave no room for the model's answer: they are dropped, and the rollout ends with the turn
    that called them; the budget of a later turn is what is left of max_completion_length."""
    tools = load_tools([f"{tools_file}:secret"])
    prompts = [[{"role": "user", "content": "the secret of ann"}]]
    first = len(ids_of(tool_tokenizer, CALL_ANN))
    suffix = len(
        tool_suffix_ids(
            tool_tokenizer, [{"role": "tool", "name": "secret", "content": "good"}], [tool_tokenizer.eos_token_id], {}
        )
    )
    turns, _, _ = rollout(tool_tokenizer, tools, {0: [CALL_ANN, "good<|im_end|>"]}, prompts, first + suffix)
    assert turns.ids[0] == ids_of(tool_tokenizer, CALL_ANN) and not any(turns.tool_mask[0])
    assert len(turns.messages[0]) == 1 and turns.calls == 1  # the tool ran; its result is not in the completion
    turns, _, generate_turn = rollout(
        tool_tokenizer, tools, {0: [CALL_ANN, "good good good<|im_end|>"]}, prompts, first + suffix + 2
    )
    assert generate_turn.calls[1][1] == [2]  # the second turn's budget: what is left
    assert len(turns.ids[0]) == first + suffix + 2 and turns.ended == [False]


def test_the_rounds_of_calls_are_limited(tool_tokenizer, tools_file):
    tools = load_tools([f"{tools_file}:secret"])
    prompts = [[{"role": "user", "content": "again and again"}]]
    turns, _, _ = rollout(tool_tokenizer, tools, {0: [CALL_ANN] * 5}, prompts, 512, max_tool_calling_iterations=2)
    assert turns.calls == 2 and [m["role"] for m in turns.messages[0]] == ["assistant", "tool"] * 2 + ["assistant"]


def test_a_process_whose_rollouts_ended_makes_the_turns_of_the_others(tool_tokenizer, tools_file, monkeypatch):
    """Another process still has a rollout going for two more turns: this one makes them too, on a row of its own
    whose turn it drops (a sharded model's forward is a collective), and its rollouts stay as they ended."""
    import rloo_utils.tools

    others = iter([True, True, False])  # this process: one turn; the other process: three
    monkeypatch.setattr(rloo_utils.tools, "any_process", lambda going_on: going_on or next(others))
    tools = load_tools([f"{tools_file}:secret"])
    turns, prompt_ids, generate_turn = rollout(
        tool_tokenizer,
        tools,
        {0: ["bad<|im_end|>", "extra<|im_end|>", "extra<|im_end|>"]},
        [[{"role": "user", "content": "hi"}]],
        in_step=True,
    )
    assert len(generate_turn.calls) == 3  # its own turn, then two it makes for the other process
    assert [budgets for _, budgets in generate_turn.calls] == [[256], [1], [1]]
    assert generate_turn.calls[1][0] == [prompt_ids[0]]
    assert turns.ids[0] == ids_of(tool_tokenizer, "bad<|im_end|>") and len(turns.messages[0]) == 1


def test_an_environment_is_reset_with_its_row_and_owns_a_reward(tool_tokenizer, tools_file):
    pool = load_environments([f"{tools_file}:Vault"])
    use = ToolUse([], {"Vault": type(pool["Vault"][0])}, pool)
    prompts = [[{"role": "user", "content": "open it"}]] * 2
    turns = use.start(prompts, {"secret_word": ["good", "bad"]})
    assert turns.prompts[0][-1]["content"] == "open it (the vault is locked)"  # what reset returned is added
    assert [s["function"]["name"] for s in turns.schemas[0]] == ["open_vault"]
    assert turns.environments[0] is pool["Vault"][0] and len(pool["Vault"]) == 2  # one instance per row, pooled
    assert turns.tools[1]["open_vault"]() == "bad"
    use.read_rewards(turns)  # as the rollout ends
    ((name, reward),) = use.reward_funcs()
    assert name == "Vault" and reward(environment_rewards=turns.rewards) == [0.0, 1.0]
    use.start(prompts, {"secret_word": ["x", "y"]})
    assert len(pool["Vault"]) == 2 and pool["Vault"][1].opened == 0  # reused and reset, not built again
    assert reward(environment_rewards=turns.rewards) == [0.0, 1.0]  # the first rollout's, read when it ended
    # a get_reward that fails is kept and raised where the rollout is scored (as a reward function's failure)
    pool["Vault"][0].get_reward = lambda: 1 / 0
    again = use.start(prompts, {"secret_word": ["x", "y"]})
    use.read_rewards(again)
    with pytest.raises(ZeroDivisionError):
        reward(environment_rewards=again.rewards)


def test_bad_tools_are_refused_in_one_line(tools_file):
    with pytest.raises(UsageError, match="has no JSON schema"):
        load_tools([f"{tools_file}:undocumented"])
    with pytest.raises(UsageError, match="does not exist"):
        load_tools(["no_such_file.py:secret"])
    with pytest.raises(UsageError, match="must be a class with a reset"):
        load_environments([f"{tools_file}:secret"])


def test_the_logprobs_of_a_multi_turn_completion_are_those_of_each_turn(tiny, tool_tokenizer, tools_file):
    """One forward over prompt + turn 1 + tool result + turn 2 gives each model token the log-prob the policy gave it
    when it generated that turn (its context then was everything before it): the update's log-probs are the
    sampler's. The tensors are a real rollout's, as the loop builds them: two rows (one calls the tool, one answers at
    once), their left-padded prompts, the completion mask the forward attends with, the loss's mask without the tool's
    tokens (the Rollout's policy_mask, which the loop takes)."""
    import rloo
    from transformers import AutoModelForCausalLM

    from rloo_utils.rollouts import Rollout

    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"]).eval()
    tools = load_tools([f"{tools_file}:secret"])
    prompts = [[{"role": "user", "content": "the secret of ann"}], [{"role": "user", "content": "say a word"}]]
    turns_by_row = {0: [CALL_ANN, "good movie<|im_end|>"], 1: ["bad<|im_end|>"]}
    turns, prompt_rows, generate_turn = rollout(tool_tokenizer, tools, turns_by_row, prompts)
    prompt_ids, prompt_mask, _, _ = tokenize_prompts(
        tool_tokenizer, turns.prompts, 512, "cpu", tools=turns.schemas
    )  # (2, P), as Sampler.sample builds them
    assert [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)] == prompt_rows
    completion_ids, completion_mask, tool_mask, ended, _ = turns.tensors(tool_tokenizer.pad_token_id, "cpu")  # (2, 256)
    sampled = Rollout(
        prompts, {}, prompt_ids, prompt_mask, completion_ids, completion_mask, tool_mask, ended, turns=turns
    )
    with torch.no_grad():
        one = rloo.completion_logprobs(policy, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0)
    loss_mask = sampled.policy_mask.bool()  # the loop's `mask = rollout.policy_mask`: the tokens the policy chose

    def logprobs_after(context: list[int], ids: list[int]) -> torch.Tensor:
        """(len(ids),) the policy's log-probs of ids after context, in one forward of that context alone."""
        with torch.no_grad():
            return rloo.completion_logprobs(
                policy,
                torch.tensor([context]),
                torch.ones(1, len(context), dtype=torch.long),
                torch.tensor([ids]),
                torch.ones(1, len(ids), dtype=torch.long),
                1.0,
            )[0]

    (first_contexts, _), (second_contexts, _) = generate_turn.calls  # what the sampler saw, turn by turn
    turn1, turn2, bad = (ids_of(tool_tokenizer, turns_by_row[row][k]) for row, k in [(0, 0), (0, 1), (1, 0)])
    assert first_contexts == prompt_rows  # the second turn came after the first and the tool's result:
    assert second_contexts == [prompt_rows[0] + turns.ids[0][: -len(turn2)]] and turns.ids[0][: len(turn1)] == turn1
    sampler = [
        torch.cat([logprobs_after(prompt_rows[0], turn1), logprobs_after(second_contexts[0], turn2)]),
        logprobs_after(prompt_rows[1], bad),
    ]
    assert loss_mask.sum(1).tolist() == [len(turn1) + len(turn2), len(bad)]
    tool_result, padding = len(turns.ids[0]) - len(turn1) - len(turn2), loss_mask.shape[1] - len(turns.ids[0])
    row_0 = [True] * len(turn1) + [False] * tool_result + [True] * len(turn2) + [False] * padding
    assert tool_result > 0 and loss_mask[0].tolist() == row_0  # turn 1, the tool's result out of the loss, turn 2
    for row in range(2):
        torch.testing.assert_close(one[row][loss_mask[row]], sampler[row], rtol=0, atol=1e-5)
    assert completion_ids[0][loss_mask[0]].tolist() == turn1 + turn2  # the loss sees the model's tokens, no tool's


def test_a_model_turn_samples_from_its_rows_seeds(tiny):
    """rloo.py's turns of a multi-turn rollout, given each row's seed (the evaluation's random streams), sample from it
    (turn_seed: the row's and the round's), not from wherever the global generator stands; another seed, another
    turn. The vLLM samplers take the same seeds to the engine."""
    from test_static_cache import sampler_and_configs

    sampler, config, _ = sampler_and_configs(tiny, 1, static=False)  # HFSampler, rows of 1; sampling at temperature 1
    tokenizer = sampler.tokenizer
    contexts, budgets, rows = [ids_of(tokenizer, "good movie"), ids_of(tokenizer, "bad")], [8, 8], [0, 2]

    def turns(global_seed: int, seeds) -> list:
        torch.manual_seed(global_seed)
        return sampler.next_turn(contexts, budgets, rows, 1, config, seeds)

    seeds = [11, 12, 13]  # one per row of the rollout; these contexts are rows 0 and 2
    assert turns(0, seeds) == turns(1, seeds)
    assert turns(0, [21, 22, 23]) != turns(0, seeds)
    assert turns(0, None) != turns(1, None)  # without seeds: the global generator's draws


OPEN_CALL = '<tool_call>{"name": "open_vault", "arguments": {}}</tool_call>'


@pytest.fixture(scope="module")
def tool_policy(tiny, tmp_path_factory):
    """The tiny policy taught, in a few supervised steps on the vault's prompt, the conversation of a tool user: it
    calls open_vault (one added token, as the template writes the call) and then says the word the tool returned; one
    example in five answers without the tool. So the greedy completion calls, by a wide margin on any CPU's rounding,
    and a sampled one does not always."""
    from transformers import AddedToken, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny["policy"])
    tokenizer.add_tokens([AddedToken(OPEN_CALL, normalized=False, special=False)])
    tokenizer.chat_template = TOOL_TEMPLATE
    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    # Seeded before the new token's embedding is drawn (from the global generator): it, and so the policy and every
    # test below, depended on the tests the worker had run before this file, and some draws (seed 0's) give a policy
    # whose greedy completion of the run's prompt answers without the tool (the check below reads "open it" alone)
    torch.manual_seed(1)
    policy.resize_token_embeddings(len(tokenizer))
    call = {"type": "function", "function": {"name": "open_vault", "arguments": {}}}
    schema = {
        "type": "function",
        "function": {
            "name": "open_vault",
            "description": "Opens the vault and reads its word.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    user = {"role": "user", "content": "open it"}  # vault_data's prompt
    conversations = [[user, {"role": "assistant", "content": "good"}]]  # a guess, without the tool
    for word in ["good", "bad", "fine", "sad"]:
        conversations.append(
            [
                user,
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "open_vault", "content": word},
                {"role": "assistant", "content": word},
            ]
        )
    examples = [
        ids_of(tokenizer, tokenizer.apply_chat_template(c, tools=[schema], tokenize=False)) for c in conversations
    ]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    for _ in range(30):
        for ids in examples:
            loss = policy(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    prompt = tokenizer.apply_chat_template([user], tools=[schema], tokenize=False, add_generation_prompt=True)
    with torch.no_grad():
        first = policy(input_ids=torch.tensor([ids_of(tokenizer, prompt)])).logits[0, -1].softmax(-1)
    call_probability = first[tokenizer.convert_tokens_to_ids(OPEN_CALL)].item()
    assert 0.6 < call_probability < 0.95, call_probability  # the tests below need both: greedy calls, sampling varies
    path = str(tmp_path_factory.mktemp("tool_policy"))
    policy.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


VAULT_WORDS = ["good", "bad", "fine", "sad"]


def last_answer(completion: str) -> str:
    """The text of a logged completion's last turn without its tool calls (the decoded completion: turns, and the tools'
    results written by TOOL_TEMPLATE, special tokens left out), as the reward function reads the last message."""
    last = completion.rsplit("</tool_response>", 1)[-1].strip().removeprefix("assistant\n")
    return re.sub(r"<tool_call>.*?</tool_call>", "", last, flags=re.DOTALL).strip()


@pytest.fixture(scope="module")
def vault_data(tmp_path_factory):
    rows = [{"prompt": [{"role": "user", "content": "open it"}], "secret_word": VAULT_WORDS[i % 4]} for i in range(16)]
    return write_jsonl(str(tmp_path_factory.mktemp("vault") / "train.jsonl"), rows)


REWARDS_PY = '''
import os


def said_the_secret(completions, environments, trainer_state, **kwargs):
    if os.environ.get("FAIL_AT_STEP") == str(trainer_state.global_step):  # the resume test's failure
        raise RuntimeError("failing on purpose")
    """1 when the last assistant turn is the environment's secret word."""
    return [float(c[-1]["role"] == "assistant" and c[-1]["content"].strip() == e.secret_word)
            for c, e in zip(completions, environments)]
'''


def vault_args(tool_policy, vault_data, tools_file, rewards, batch_size=16, rounds=1) -> list:
    """The options of a run of the tool policy on the vault: one environment per rollout, a reward function that reads
    the messages and the environments, 2 updates."""
    return [
        "--model_name_or_path",
        tool_policy,
        "--dataset_name",
        vault_data,
        "--environment",
        f"{tools_file}:Vault",
        "--reward_funcs",
        f"{rewards}:said_the_secret",
        "--total_episodes",
        32,
        "--per_device_train_batch_size",
        batch_size,
        "--max_completion_length",
        96,
        "--max_tool_calling_iterations",
        rounds,
        "--num_sample_generations",
        1,
    ]


def vault_run_proc(script, tool_policy, vault_data, tools_file, rewards, cwd, *extra):
    return run_rloo(
        *vault_args(tool_policy, vault_data, tools_file, rewards), "--log_completions", *extra, cwd=cwd, script=script
    )


def vault_run(script, tool_policy, vault_data, tools_file, rewards, cwd, *extra):
    proc = vault_run_proc(script, tool_policy, vault_data, tools_file, rewards, cwd, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = os.listdir(cwd / "runs")
    with open(cwd / "runs" / run / "completions.jsonl") as f:
        completions = [json.loads(line) for line in f]
    with open(cwd / "runs" / run / "samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    return read_metrics(cwd), completions, samples


@pytest.fixture(scope="module")
def vault_server(tool_policy, tmp_path_factory):
    """A vLLM server of the tool policy, for this module's runs: its url."""
    from conftest import start_vllm_server

    server = start_vllm_server({"policy": tool_policy}, tmp_path_factory)
    yield next(server)["url"]
    server.close()  # the server stops


@pytest.fixture(scope="module")
def vault_runs(tool_policy, vault_data, tools_file, vault_server, tmp_path_factory):
    """The tool policy's runs on the vault: rloo.py's (HF generate), and rloo_vllm.py's on a vLLM server, each turn
    one request of token ids (a later turn seeded from its row's seed), synchronous and with --max_staleness 1 (each
    multi-turn rollout made whole in the queue's thread): (metrics, completions, sample tables). A colocated engine
    takes the same turns through the same generate_turn (its engine.generate is every colocated test's); CI runs the
    server, the path that differs more."""
    rewards = tmp_path_factory.mktemp("rewards") / "rewards.py"
    rewards.write_text(REWARDS_PY)
    runs = {
        "rloo.py": vault_run("rloo.py", tool_policy, vault_data, tools_file, rewards, tmp_path_factory.mktemp("run"))
    }
    server_mode = ["--vllm_mode", "server", "--vllm_server_base_url", vault_server]
    for name, extra in [("rloo_vllm.py", []), ("rloo_vllm.py async", ["--max_staleness", 1])]:
        cwd = tmp_path_factory.mktemp("server_run")
        runs[name] = vault_run("rloo_vllm.py", tool_policy, vault_data, tools_file, rewards, cwd, *server_mode, *extra)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo.py", "rloo_vllm.py", "rloo_vllm.py async"])
def test_a_run_trains_on_multi_turn_rollouts_with_an_environment(script, vault_runs):
    """End to end: the environment reset per rollout, the policy calls its tool, the result goes into the completion,
    the reward functions get the messages and the environments, get_reward is a source of its own, and the rewards
    logged are what said_the_secret gives for what each completion said. With vLLM, its log-probs are kept per model
    token and are the trainer's (the tools' tokens masked out). Made ahead (async), each rollout's environments are its
    own while the next rollout is made: get_reward and said_the_secret still read each completion's."""
    metrics, completions, _ = vault_runs[script]
    assert len(metrics) == 2
    assert any(row["tools/call_frequency"] > 0 for row in metrics)
    for row in metrics:
        assert row["tools/call_frequency"] <= 1  # one round of calls at most, one call each
        assert row["tools/failure_frequency"] == 0
        assert row["rewards/Vault/mean"] == pytest.approx(row["tools/call_frequency"])  # get_reward: calls made
        assert "rewards/said_the_secret/mean" in row
        assert row["completions/max_length"] <= 96  # the policy's tokens
    with_result = [r for r in completions if "<tool_response>" in r["completion"]]
    assert with_result and all(r["Vault"] == 1 for r in with_result)  # the result is in the completion, after a call
    # The rewards logged are what the reward function gives for what the run did: 1 where the last answer is the
    # secret word, which a completion shows where the vault was opened (its tool's result); any other answer scores 0
    for r in completions:
        answer = last_answer(r["completion"])
        if "<tool_response>" in r["completion"]:
            word = r["completion"].rsplit("<tool_response>", 1)[1].split("</tool_response>")[0].strip()
            assert word in VAULT_WORDS and r["said_the_secret"] == float(answer == word), r
        else:
            assert r["said_the_secret"] in (0.0, 1.0) and (r["said_the_secret"] == 0 or answer in VAULT_WORDS), r
    assert any(r["said_the_secret"] == 1 for r in with_result)  # (the tool policy says the word it read)
    for row in metrics:  # and each update's means are those of its completions
        update = [r for r in completions if r["step"] == row["step"]]
        assert len(update) == 16
        assert row["rewards/said_the_secret/mean"] == pytest.approx(
            statistics.mean(r["said_the_secret"] for r in update)
        )
        assert row["reward"] == pytest.approx(statistics.mean(r["said_the_secret"] + r["Vault"] for r in update))
    if script != "rloo.py":  # the server's log-probs of the model's tokens are the trainer's, from the same weights
        assert all(
            row["sampling/sampling_logp_difference/max"] < 1e-3 for row in metrics if not row.get("async/staleness")
        )


@pytest.mark.slow
def test_a_multi_turn_rollout_made_ahead_is_the_one_made_in_step_from_the_same_weights(vault_runs):
    """With --max_staleness 1 the rollout of update 1 is made in the queue's thread from the initial weights, as the
    synchronous run makes it in the training thread: the same completions (tool results and later turns included) and
    rewards; update 2's comes from the initial weights too (one version old), where the synchronous run's does not."""
    (sync, sync_completions, _), (made_ahead, completions, _) = (
        vault_runs["rloo_vllm.py"],
        vault_runs["rloo_vllm.py async"],
    )
    assert [row["async/staleness"] for row in made_ahead] == [0, 1]
    assert [row["async/resampled"] for row in made_ahead] == [0, 0]
    assert "async/staleness" not in sync[0]
    first = [
        [(r["prompt"], r["completion"], r["said_the_secret"], r["Vault"]) for r in c if r["step"] == sync[0]["step"]]
        for c in (sync_completions, completions)
    ]
    assert len(first[0]) == 16
    assert first[0] == first[1] and any("<tool_response>" in c for _, c, _, _ in first[0])
    assert made_ahead[0]["reward"] == sync[0]["reward"]
    assert made_ahead[1]["sampling/sampling_logp_difference/max"] > 1e-3  # sampled from the weights before update 1


@pytest.mark.slow
def test_dynamic_sampling_on_multi_turn_rollouts_trains_and_logs_the_rows_it_keeps(
    tool_policy, vault_data, tools_file, tmp_path
):
    """--dynamic_sampling with the vault's environments: the extra rounds reset environments of the pool after the
    first round's were scored, and the update keeps whole groups of every round: the completions table holds the kept
    rows with the rewards (and the environments' get_reward) they were given, the update's means are theirs, and the
    tools' counts are over every completion sampled."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS_PY)
    (tmp_path / "run").mkdir()
    extra = ["--dynamic_sampling", "--max_sampling_rounds", 3, "--seed", 4]
    metrics, completions, _ = vault_run(
        "rloo.py", tool_policy, vault_data, tools_file, rewards, tmp_path / "run", *extra
    )
    assert any(row["sampling/rounds"] > 1 for row in metrics)
    for row in metrics:
        assert row["sampling/groups_kept"] + row["sampling/groups_short"] == 4
        assert 0 < row["tools/call_frequency"] <= 1
        update = [r for r in completions if r["step"] == row["step"]]
        assert len(update) == 16
        assert row["rewards/said_the_secret/mean"] == pytest.approx(
            statistics.mean(r["said_the_secret"] for r in update)
        )
        assert row["rewards/Vault/mean"] == pytest.approx(statistics.mean(r["Vault"] for r in update))
        scores = [r["said_the_secret"] + r["Vault"] for r in update]
        groups = [scores[i : i + 4] for i in range(0, 16, 4)]
        kept = sum(max(g) > min(g) for g in groups)  # the groups with varied scores: those kept
        assert kept == row["sampling/groups_kept"], (groups, row)


@pytest.mark.slow
def test_vllm_and_hf_generation_lay_out_a_multi_turn_completion_alike(vault_runs):
    """The greedy sample table before any update, with rloo.py's HF generation and rloo_vllm.py's vLLM server: the
    same completions, tool results and second turns included."""
    tables = [
        [(r["prompt"], r["completion"]) for r in vault_runs[script][2] if r["step"] == 0] for script in vault_runs
    ]
    assert tables[0] == tables[1] and any("<tool_response>" in c for _, c in tables[0]), tables


@pytest.mark.slow
def test_two_processes_make_every_turn_together_and_count_every_call(tool_policy, vault_data, tools_file, tmp_path):
    """rloo_multigpu.py on 2 processes (gloo, FSDP2): a process whose rollouts have ended makes the turns the other
    still makes (a sharded forward is a collective: else both would hang), and the calls are counted over both."""
    from test_multigpu import run_torchrun

    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS_PY)
    proc = run_torchrun(
        2,
        *vault_args(tool_policy, vault_data, tools_file, rewards, batch_size=8, rounds=2),
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(tmp_path)
    assert len(metrics) == 2 and any(row["tools/call_frequency"] > 0 for row in metrics)
    for row in metrics:  # get_reward counts each rollout's calls: over the whole batch, as the call frequency
        assert row["rewards/Vault/mean"] == pytest.approx(row["tools/call_frequency"])


@pytest.mark.slow
def test_a_multi_turn_run_that_fails_resumes_as_the_same_run(
    tool_policy, vault_data, tools_file, tmp_path, monkeypatch
):
    """A reward function fails in update 3: the run stops with the checkpoint of update 2, and the run resumed from it
    (its environments built again, their tools' results drawn again) is the uninterrupted run, weights included."""
    from conftest import run_outcome

    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS_PY)
    runs = []
    for name in ["uninterrupted", "resumed"]:
        (tmp_path / name).mkdir()
        args = ["--run_name", "run", "--total_episodes", 64, "--save_steps", 0]
        if name == "resumed":
            monkeypatch.setenv("FAIL_AT_STEP", "2")
            failed = vault_run_proc("rloo.py", tool_policy, vault_data, tools_file, rewards, tmp_path / name, *args)
            assert failed.returncode != 0 and "failing on purpose" in failed.stderr
            assert os.listdir(tmp_path / name / "runs" / "run" / "checkpoints") == ["checkpoint-2"]
            monkeypatch.delenv("FAIL_AT_STEP")
            args += ["--resume_from_checkpoint", "latest"]
        vault_run("rloo.py", tool_policy, vault_data, tools_file, rewards, tmp_path / name, *args)
        runs.append(run_outcome(str(tmp_path / name / "runs" / "run")))
    (metrics, samples, weights), (metrics_again, samples_again, weights_again) = runs
    assert [r["step"] for r in metrics_again] == [r["step"] for r in metrics] and metrics_again == metrics
    assert samples_again == samples and any(r.get("tools/call_frequency", 0) > 0 for r in metrics)
    assert all(torch.equal(weights[k], weights_again[k]) for k in weights)


@pytest.mark.slow
def test_a_sigkilled_run_with_tools_made_ahead_resumes_as_the_same_run(
    tool_policy, vault_data, tools_file, vault_server, tmp_path
):
    """--tools with --max_staleness 1 on a server: the checkpoint after update 3 keeps the multi-turn rollout of update
    4 (made whole from the weights after update 2, gone by then), and the resumed run trains on it: it ends as the
    uninterrupted run, metrics, sample tables and weights."""
    from conftest import run_outcome
    from test_vllm import REWARDS, sigkill_after_updates

    args = [
        *("--model_name_or_path", tool_policy, "--dataset_name", vault_data, "--tools", f"{tools_file}:open_vault"),
        *("--reward_funcs", f"{REWARDS}:slow_text_length", "--total_episodes", 48, "--per_device_train_batch_size", 8),
        *("--max_completion_length", 96, "--max_tool_calling_iterations", 1, "--num_sample_generations", 2),
        *("--save_steps", 3, "--run_name", "run", "--vllm_mode", "server", "--vllm_server_base_url", vault_server),
        *("--max_staleness", 1),
    ]
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    reference.mkdir(), interrupted.mkdir()
    proc = run_rloo(*args, cwd=reference, script="rloo_vllm.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = run_outcome(str(reference / "runs" / "run"))
    assert [r["async/staleness"] for r in expected[0]] == [0, 1, 1, 1, 1, 1]
    assert any(r["tools/call_frequency"] > 0 for r in expected[0])
    assert "<tool_response>" in expected[1]  # the tool's results in the sample tables' completions (not rolled back)

    sigkill_after_updates(args, interrupted, 4)
    checkpoint = interrupted / "runs" / "run" / "checkpoints" / "checkpoint-3"
    state = torch.load(checkpoint / "training_state.pt", weights_only=True)
    kept = state["rollouts"]["per_process"][0]["kept"]
    assert list(kept) == [4] and kept[4]["version"] == 2 and "rollout" in kept[4]  # made whole, kept whole
    resumed = run_rloo(*args, "--resume_from_checkpoint", "latest", cwd=interrupted, script="rloo_vllm.py")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = run_outcome(str(interrupted / "runs" / "run"))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert all(torch.equal(got[2][k], expected[2][k]) for k in expected[2])


@pytest.mark.slow
def test_a_run_with_environments_made_ahead_resumes_and_samples_the_rollout_in_flight_again(
    tool_policy, vault_data, tools_file, vault_server, tmp_path, monkeypatch
):
    """A reward function fails in update 3 of a run with --environment and --max_staleness 1: its checkpoint (update 2)
    cannot keep the rollout of update 3 made ahead (its environments are the user's objects), says so in one line,
    and the resumed run samples it again from the checkpoint's weights (staleness 0) and trains to the end."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS_PY)
    extra = ["--run_name", "run", "--total_episodes", 64, "--save_steps", 0, "--max_staleness", 1]
    extra += ["--vllm_mode", "server", "--vllm_server_base_url", vault_server]
    monkeypatch.setenv("FAIL_AT_STEP", "2")
    failed = vault_run_proc("rloo_vllm.py", tool_policy, vault_data, tools_file, rewards, tmp_path, *extra)
    assert failed.returncode != 0 and "failing on purpose" in failed.stderr
    monkeypatch.delenv("FAIL_AT_STEP")
    resumed = vault_run_proc(
        "rloo_vllm.py",
        tool_policy,
        vault_data,
        tools_file,
        rewards,
        tmp_path,
        *extra,
        "--resume_from_checkpoint",
        "latest",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "could not keep the multi-turn rollouts of updates [3]" in resumed.stdout
    metrics = read_metrics(tmp_path)
    assert [r["async/staleness"] for r in metrics] == [0, 1, 0, 1]  # update 3's sampled again from update 2's weights
    for row in metrics:
        assert row["rewards/Vault/mean"] == pytest.approx(row["tools/call_frequency"])


@pytest.mark.slow
def test_two_processes_make_their_multi_turn_rollouts_ahead_on_a_server(
    tool_policy, vault_data, tools_file, vault_server, vault_runs, tmp_path
):
    """rloo_multigpu.py on 2 processes with a server and --max_staleness 1: each process makes its own rows' turns in
    its queue's thread (no collective there), and the rollouts are the single-process run's: update 1's completions,
    from the same weights and seeds, are rloo_vllm.py's."""
    from test_multigpu import run_torchrun

    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS_PY)
    proc = run_torchrun(
        2,
        *vault_args(tool_policy, vault_data, tools_file, rewards, batch_size=8),
        *("--vllm_server_base_url", vault_server, "--max_staleness", 1, "--log_completions"),
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(tmp_path)
    assert [row["async/staleness"] for row in metrics] == [0, 1]
    for row in metrics:  # get_reward counts each rollout's calls: over the whole batch, as the call frequency
        assert row["rewards/Vault/mean"] == pytest.approx(row["tools/call_frequency"])
    (run,) = os.listdir(tmp_path / "runs")
    with open(tmp_path / "runs" / run / "completions.jsonl") as f:
        completions = [json.loads(line) for line in f]
    _, single, _ = vault_runs["rloo_vllm.py async"]
    step = metrics[0]["step"]
    assert sorted((r["prompt"], r["completion"]) for r in completions if r["step"] == step) == sorted(
        (r["prompt"], r["completion"]) for r in single if r["step"] == step
    )


@pytest.mark.slow
def test_rloo_py_refuses_a_template_without_tools_before_loading_the_policy(tiny, vault_data, tools_file, tmp_path):
    proc = run_rloo(
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        vault_data,
        "--environment",
        f"{tools_file}:Vault",
        cwd=tmp_path,
    )
    check_one_line_error(proc, "drops tool calls or tool results")
    proc = run_rloo("--model_name_or_path", tiny["policy"], "--tools", f"{tools_file}:undocumented", cwd=tmp_path)
    check_one_line_error(proc, "has no JSON schema")
