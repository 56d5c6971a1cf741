"""Multi-turn rollouts with tools and environments, on TRL 1.16 GRPOTrainer's contract (docs/tools.md): a tool is a
typed Python function with a Google-style docstring, whose JSON schema the chat template shows the model; an
environment is a class, one instance per rollout, reset with its dataset row, whose public methods are its tools and
whose optional get_reward() is a reward source. The model's turns and the tools' results alternate, concatenated as
token ids: the model's as it sampled them, the results' as the chat template renders them, never re-tokenised."""

import asyncio
import inspect
import json
import threading
import re
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional

import torch

from rloo_utils.errors import RunError, UsageError, describe
from rloo_utils.processes import any_process
from rloo_utils.rewards import RewardTimeout, await_all, load_reward_func, within


@dataclass
class ToolUseOptions:
    """Tools and environments: multi-turn rollouts (docs/tools.md)"""

    RESUMABLE: ClassVar = {"tool_timeout"}  # a bound on a hung tool: calls within it answer as before

    tools: Optional[list[str]] = None
    """functions the model may call, `file.py:function` or `module:function`: typed, with a Google-style docstring"""
    environment: Optional[list[str]] = None
    """classes `file.py:Class`, one per rollout: reset(**row), its methods are tools, get_reward() a reward source"""
    max_tool_calling_iterations: Optional[int] = None
    """rounds of tool calls a rollout may make; None: until the model answers without one or runs out of tokens"""
    tool_timeout: Optional[float] = None
    """seconds a tool call may take, after which it is answered with an error (one line); None: no limit"""

    def check(self) -> None:
        """The multi-turn options; the tools and environments themselves are loaded, and checked, by load_tools."""
        if self.max_tool_calling_iterations is not None:
            if self.max_tool_calling_iterations < 0:
                raise UsageError(f"--max_tool_calling_iterations must be >= 0, got {self.max_tool_calling_iterations}")
            if not self.tools and not self.environment:
                raise UsageError("--max_tool_calling_iterations needs tools to call: give --tools or --environment")
        if self.tool_timeout is not None and not self.tool_timeout > 0:
            raise UsageError(f"--tool_timeout must be > 0 (or left out: no limit), got {self.tool_timeout}")
        if (self.tools or self.environment) and "tools" in (self.chat_template_kwargs or {}):
            raise UsageError(
                "--chat_template_kwargs sets tools and --tools/--environment gives them too: give them once, as --tools"
            )


# The tool-call format of Hermes-style chat templates (Qwen2.5, Qwen3, SmolLM3, NousResearch's Hermes):
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>. A tokenizer that carries its own response_template
# (transformers' response parsing) is parsed with that instead.
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
ENVIRONMENT_COLUMN = "environment"  # with several --environment classes, each row names its class here (TRL's field)


# ---- Loading ---------------------------------------------------------------------------------------------------------
def tool_schema(func: Callable, name: str) -> dict:
    """The JSON schema a chat template takes for a tool (transformers' get_json_schema: type hints and a Google-style
    docstring with an Args section describing every argument)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(func)
    except Exception as e:
        raise UsageError(
            f"tool {name} has no JSON schema ({describe(e)}): give it type hints and a Google-style docstring whose "
            "Args section describes every argument"
        ) from None


def load_tools(specs: list[str]) -> list[Callable]:
    """--tools: `file.py:function` or `module:function`, each with a schema (checked here, before any model loads)."""
    tools = [load_reward_func(spec, {}, "tool", "--tools") for spec in specs]
    for tool, spec in zip(tools, specs):
        if not isinstance(getattr(tool, "__name__", None), str):  # the model calls a tool by its name
            raise UsageError(f"tool {spec} has no __name__ (a functools.partial?): give it as a def")
    names = [t.__name__ for t in tools]
    for tool, name in zip(tools, names):
        tool_schema(tool, name)
    if len(set(names)) < len(names):
        raise UsageError(f"two tools have the same name ({', '.join(names)}): the model calls a tool by its name")
    return tools


def environment_methods(environment) -> list[Callable]:
    """An environment's tools: its public methods, other than reset and get_reward (bound to the instance)."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def load_environments(specs: list[str]) -> dict[str, list]:
    """--environment: `file.py:Class` or `module:Class`, by class name: a pool of instances of each, holding the one
    built here (its tools' schemas checked on it). With several, a dataset column `environment` names each row's."""
    classes = {}
    for spec in specs:
        cls = load_reward_func(spec, {}, "environment", "--environment")
        if not inspect.isclass(cls) or not callable(getattr(cls, "reset", None)):
            raise UsageError(
                f"environment {spec} must be a class with a reset(**row) method (TRL's environment_factory)"
            )
        if cls.__name__ in classes:
            raise UsageError(f"two environments are named {cls.__name__}: a row names its environment by class name")
        try:
            instance = cls()
        except Exception as e:
            raise UsageError(f"could not build environment {cls.__name__}() ({describe(e)})") from None
        for method in environment_methods(instance):
            tool_schema(method, f"{cls.__name__}.{method.__name__}")
        classes[cls.__name__] = [instance]
    return classes


# ---- The chat template's tool-call format ----------------------------------------------------------------------------
def render_ids(tokenizer, messages: list[dict], chat_template_kwargs: dict, **kwargs) -> list[int]:
    """The token ids of a conversation as the chat template writes it (tokenised as the prompts are)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs, **chat_template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def parse_turn(tokenizer, prefix_ids: list[int], ids: list[int], tools: Optional[list] = None) -> dict:
    """One assistant turn as a message: its text, and its tool calls where it made any. A malformed call (not JSON, no
    name) makes no call: the turn is text, as in TRL."""
    if getattr(tokenizer, "response_template", None) is not None:  # the tokenizer's own parser
        try:
            message = tokenizer.parse_response(ids, prefix=prefix_ids, tools=tools)
            if message is None:
                raise ValueError("nothing parsed")
        except (ValueError, TypeError):
            return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
        return {**message, "role": "assistant", "content": message.get("content") or ""}
    text = tokenizer.decode(ids, skip_special_tokens=True)
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            arguments = call.get("arguments", {})
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            if not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
                raise ValueError("no name, or arguments that are not an object")
        except (ValueError, AttributeError):
            return {"role": "assistant", "content": text}
        calls.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
    message = {"role": "assistant", "content": TOOL_CALL.sub("", text).strip() if calls else text}
    return {**message, "tool_calls": calls} if calls else message


def tool_suffix_ids(tokenizer, tool_messages: list[dict], stop_ids: list[int], chat_template_kwargs: dict) -> list[int]:
    """The ids the chat template writes between a turn that called tools and the model's next turn: the tool messages
    and the generation prompt. Rendered once with and once without them after a turn that called the first tool; the
    model's turn ends at its stop token, so what the template writes after that (a newline) is the suffix's."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    before = render_ids(tokenizer, head, chat_template_kwargs)
    after = render_ids(tokenizer, head + tool_messages, chat_template_kwargs, add_generation_prompt=True)
    stops = [i for i, t in enumerate(before) if t in stop_ids]
    cut = stops[-1] + 1 if stops else len(before)
    if after[:cut] != before[:cut]:
        raise RunError(
            "the chat template writes an assistant turn differently once tool results follow it, so a multi-turn "
            "completion cannot be its turns' ids concatenated: give a template that keeps earlier turns as they were"
        )
    return after[cut:]


def check_tool_format(tokenizer, stop_ids: list[int], chat_template_kwargs: dict, model: str) -> None:
    """Before any model loads: the chat template shows tools, writes a tool call and a tool result, keeps earlier turns
    as they were, and its tool-call format is one parse_turn reads back (a call rendered, then parsed)."""
    call = {"type": "function", "function": {"name": "tool_name_q7", "arguments": {"argument_q7": "value_q7"}}}
    user = [{"role": "user", "content": "hi"}]
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    result = {"role": "tool", "name": "tool_name_q7", "content": "result_q7"}
    fix = "give a tool-calling chat template (--chat_template_kwargs '{\"chat_template\": ...}')"
    try:
        text = tokenizer.apply_chat_template(user + [assistant, result], tokenize=False, **chat_template_kwargs)
    except Exception as e:
        raise UsageError(f"the chat template of {model} cannot write a tool call ({describe(e)}): {fix}") from None
    missing = [s for s in ("tool_name_q7", "argument_q7", "value_q7", "result_q7") if s not in text]
    if missing:
        raise UsageError(f"the chat template of {model} drops tool calls or tool results (no {missing[0]}): {fix}")
    prompt = render_ids(tokenizer, user, chat_template_kwargs, add_generation_prompt=True)
    turn = render_ids(tokenizer, user + [assistant], chat_template_kwargs)
    parsed = parse_turn(tokenizer, prompt, turn[len(prompt) :] if turn[: len(prompt)] == prompt else turn)
    if [c.get("function", c) for c in parsed.get("tool_calls") or []] != [call["function"]]:
        raise UsageError(
            f"the tool calls of {model}'s chat template are not in a format this project reads (<tool_call>{{json}}"
            "</tool_call>): set the tokenizer's response_template (transformers' response parsing) or give a "
            "Hermes-style template"
        )
    try:
        tool_suffix_ids(tokenizer, [result], stop_ids, chat_template_kwargs)
    except RunError as e:
        raise UsageError(f"{model}: {e}") from None


# ---- One rollout's tools ---------------------------------------------------------------------------------------------
class ToolTimeout(Exception):
    """A tool call past --tool_timeout."""


def call_tools(calls: list[dict], tools: dict[str, Callable], timeout: Optional[float] = None) -> tuple:
    """The tool messages that answer one turn's calls, in order, how many calls failed and how many of them ran past
    --tool_timeout. A failing call (an unknown tool, bad arguments, an exception) answers with its error and the
    rollout goes on, as in TRL; so does one past the timeout (said in one line; Python cannot stop a plain function:
    its thread is left to finish)."""
    messages, failures, timeouts = [], 0, 0
    for call in calls:
        function = call.get("function", call)
        name = function.get("name", "unknown")
        try:
            if call.get("type", "function") != "function":
                raise ValueError(f"Unsupported tool call type: {call['type']}")
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            result = run_tool(tools[name], function.get("arguments") or {}, timeout)
        except Exception as e:
            failures += 1
            result = {"error": str(e)}
            if isinstance(e, ToolTimeout):
                timeouts += 1
                print(f"tool {name} did not return within --tool_timeout {timeout:g} s: answered with an error")
        messages.append({"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)})
    return messages, failures, timeouts


def run_tool(tool: Callable, arguments: dict, timeout: Optional[float]):
    """A tool's result: a plain one called in a thread given `timeout` seconds (rewards.within; in this thread without
    one), an async one awaited on the reward functions' event loop as long. Past it: ToolTimeout (a TimeoutError the
    tool raises itself is its own failure)."""
    try:
        result = within(timeout, "tool", lambda: tool(**arguments))
    except RewardTimeout:
        raise ToolTimeout(f"the tool did not return within {timeout:g} s") from None
    if inspect.isawaitable(result):  # an async tool's coroutine
        result = await_all([bounded(result, timeout)])[0]
        if isinstance(result, BaseException):
            raise result
    return result


async def bounded(awaitable, timeout: Optional[float]):
    """The awaitable's result, or ToolTimeout past `timeout` seconds (None: no limit)."""
    try:
        async with asyncio.timeout(timeout) as scope:
            return await awaitable
    except TimeoutError:
        if scope.expired():
            raise ToolTimeout(f"the tool did not return within {timeout:g} s") from None
        raise


@dataclass
class MultiTurn:
    """A batch of multi-turn rollouts. Per row, from ToolUse.start: its prompt (with what its environment's reset
    added), its environment (or None), the schemas of the tools it is shown, its tools by name. Then from generate:
    its completion's ids (the model's turns and the tools' results between them), which of them are the tools' (1)
    rather than the model's (0), the sampler's log-probs of them where it gives them (0 on the tools'), its messages,
    whether its last turn ended with a stop token."""

    prompts: list
    environments: list
    schemas: list[list[dict]]
    tools: list[dict[str, Callable]]
    ids: list[list[int]] = field(default_factory=list)
    tool_mask: list[list[int]] = field(default_factory=list)
    sampler_logprobs: list[list[float]] = field(default_factory=list)
    messages: list[list[dict]] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)
    abandoned: list[bool] = field(default_factory=list)  # a tool call of the row ran past --tool_timeout
    calls: int = 0
    failures: int = 0
    completions: int = 0  # the rows the two counts are over: this batch's, or every round's (gather)
    width: int = 0
    sampler_gave_logprobs: bool = True  # False: HF generate's turns, which come without log-probs
    owned: bool = False  # its environments are its own until it is scored (ToolUse.release)
    released: bool = False  # scored: its own environments given back
    rewards: dict = field(default_factory=dict)  # per environment class: get_reward of each row (ToolUse.read_rewards)

    def generate(
        self,
        generate_turn: Callable,
        prompt_ids: list[list[int]],
        tokenizer,
        stop_ids: list[int],
        *,
        max_completion_length: int,
        max_tool_calling_iterations: Optional[int],
        tool_timeout: Optional[float],
        chat_template_kwargs: Optional[dict],
        in_step=False,
    ):
        """The model generates; each tool call it makes is run and its result appended as the template renders it;
        the model goes on after the results, until it answers without a call, --max_tool_calling_iterations rounds
        of calls have run, or the completion reaches --max_completion_length (counted over every turn and result;
        results that would leave no room for a model token are rolled back, and the rollout ends with the turn that
        called them). generate_turn(contexts, budgets, rows, round): the model's next turn after each context (a
        prompt and its completion so far; rows: whose; round: how many rounds of calls came before), as its ids up to
        and including its first stop token, at most budget of them, and their sampling log-probs (or None). in_step:
        every process makes every turn (a sharded model's forward is a collective); else each its own."""
        rows, limit, rounds = len(prompt_ids), max_completion_length, max_tool_calling_iterations
        template_kwargs = chat_template_kwargs or {}
        self.ids, self.tool_mask = [[] for _ in range(rows)], [[] for _ in range(rows)]
        self.sampler_logprobs, self.sampler_gave_logprobs = [[] for _ in range(rows)], True
        self.messages, self.ended, self.width = [[] for _ in range(rows)], [False] * rows, limit
        self.abandoned = [False] * rows
        self.completions = rows
        active, round_ = list(range(rows)), 0
        while any_process(bool(active)) if in_step else active:
            if not active:  # this process's rollouts have ended: it makes the turn on a row of its own, and drops it
                generate_turn([prompt_ids[0]], [1], [0], round_)
                round_ += 1
                continue
            contexts = [prompt_ids[i] + self.ids[i] for i in active]
            turns = generate_turn(contexts, [limit - len(self.ids[i]) for i in active], active, round_)
            going_on = []
            for i, context, (ids, logprobs) in zip(active, contexts, turns):
                self.ids[i] += ids
                self.tool_mask[i] += [0] * len(ids)
                self.sampler_logprobs[i] += logprobs if logprobs is not None else [0.0] * len(ids)
                self.sampler_gave_logprobs &= logprobs is not None
                self.ended[i] = bool(ids) and ids[-1] in stop_ids
                message = parse_turn(tokenizer, context, ids, self.schemas[i])
                self.messages[i].append(message)
                if not message.get("tool_calls") or not self.ended[i] or rounds is not None and round_ >= rounds:
                    continue
                results, failures, timeouts = call_tools(message["tool_calls"], self.tools[i], tool_timeout)
                self.abandoned[i] |= timeouts > 0  # a call left running may still change its environment
                self.calls, self.failures = self.calls + len(results), self.failures + failures
                suffix = tool_suffix_ids(tokenizer, results, stop_ids, template_kwargs)
                if len(self.ids[i]) + len(suffix) >= limit:
                    continue  # rolled back: the results would leave no room for the model's answer
                self.ids[i] += suffix
                self.tool_mask[i] += [1] * len(suffix)
                self.sampler_logprobs[i] += [0.0] * len(suffix)  # not sampled: never in the loss
                self.messages[i] += results
                going_on.append(i)
            active, round_ = going_on, round_ + 1

    @staticmethod
    def gather(pieces: list[tuple["MultiTurn", list[int]]]) -> "MultiTurn":
        """The chosen rows of several batches as one (--dynamic_sampling's rounds); the tools' counts stay those of
        every row sampled; each row's environment reward as read when its round ended."""
        per_row = ("prompts", "environments", "schemas", "tools", "ids", "tool_mask", "sampler_logprobs", "messages")
        return MultiTurn(
            **{
                name: [getattr(turns, name)[i] for turns, rows in pieces for i in rows] for name in per_row + ("ended",)
            },
            calls=sum(turns.calls for turns, _ in pieces),
            failures=sum(turns.failures for turns, _ in pieces),
            completions=sum(turns.completions for turns, _ in pieces),
            width=max(turns.width for turns, _ in pieces),
            sampler_gave_logprobs=all(turns.sampler_gave_logprobs for turns, _ in pieces),
            rewards={name: [t.rewards[name][i] for t, rows in pieces for i in rows] for name in pieces[0][0].rewards},
            abandoned=[bool(t.abandoned and t.abandoned[i]) for t, rows in pieces for i in rows],
        )

    def state_dict(self) -> dict:
        """What a checkpoint keeps of a finished rollout without environments (Rollout.state_dict, as JSON): its
        conversations and counts; the tools are the run's, and not needed again."""
        per_row = ("prompts", "ids", "tool_mask", "sampler_logprobs", "messages", "ended")
        counts = ("calls", "failures", "completions", "width", "sampler_gave_logprobs", "rewards")
        return {name: getattr(self, name) for name in per_row + counts}

    @staticmethod
    def from_state_dict(state: dict) -> "MultiTurn":
        rows = len(state["prompts"])
        return MultiTurn(environments=[None] * rows, schemas=[[] for _ in range(rows)], tools=[{}] * rows, **state)

    def tensors(self, pad_token_id: int, device) -> tuple[torch.Tensor, ...]:
        """(B, C) ids padded with pad_token_id to --max_completion_length, completion mask, tool mask; (B,) ended;
        (B, C) the sampler's log-probs (0 past the end and on the tools' tokens; None where it gave none)."""
        ids = torch.full((len(self.ids), self.width), pad_token_id, dtype=torch.long)
        completion_mask, tool_mask = torch.zeros_like(ids), torch.zeros_like(ids)
        sampler_logprobs = torch.zeros(ids.shape)
        for i, (row, tools, logprobs) in enumerate(zip(self.ids, self.tool_mask, self.sampler_logprobs)):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            completion_mask[i, : len(row)] = 1
            tool_mask[i, : len(row)] = torch.tensor(tools, dtype=torch.long)
            sampler_logprobs[i, : len(row)] = torch.tensor(logprobs)
        ended = torch.tensor(self.ended)
        sampler_logprobs = sampler_logprobs.to(device) if self.sampler_gave_logprobs else None
        return *(t.to(device) for t in (ids, completion_mask, tool_mask, ended)), sampler_logprobs


@dataclass
class ToolUse:
    """The tools a run offers: the standalone ones (--tools) and the environments' (--environment), with one
    environment instance per rollout row, reset for each rollout (TRL: built once, reset often). The training thread's
    rollouts take the pool's instances by row (each is scored before the next starts). A rollout made ahead in the
    rollout queue's thread (--max_staleness) owns its instances until it is scored (release): they come from a pool of
    their own, which grows to what the rollouts in flight hold, so that no instance is reset under a rollout not yet
    scored."""

    tools: list[Callable]
    environments: dict[str, type]
    pool: dict[str, list]  # per class: the training thread's instances, row i's at index i
    max_tool_calling_iterations: Optional[int] = None  # rounds of calls in a rollout (None: until it answers)
    tool_timeout: Optional[float] = None  # the seconds a tool call may take (None: no limit)
    reward_timeout: Optional[float] = None  # the seconds an environment's get_reward may take (None: no limit)
    free: dict[str, list] = field(default_factory=dict)  # per class: the queue's thread's instances, not owned now
    lock: threading.Lock = field(default_factory=threading.Lock)  # free is taken from and given back in two threads

    def environment_of(self, columns: dict, row: int) -> Optional[str]:
        if not self.environments:
            return None
        if len(self.environments) == 1:
            return next(iter(self.environments))
        name = columns[ENVIRONMENT_COLUMN][row]
        if name not in self.environments:
            raise RunError(
                f"a row names environment {name!r}, which is none of --environment's ({', '.join(self.environments)})"
            )
        return name

    def start(self, prompts: list, columns: dict, owned: bool = False) -> MultiTurn:
        """One environment per row, reset with its dataset row (the prompt and the other columns; a text that reset
        returns is added to the last message, as in TRL), and the tools each row is shown. owned: the rollout owns its
        instances until release (one made in the queue's thread)."""
        prompts, taken = list(prompts), {}
        environments, schemas, row_tools = [], [], []
        for i, prompt in enumerate(prompts):
            name = self.environment_of(columns, i)
            environment = None
            if name is not None and owned:
                with self.lock:  # the first free one (row i's of the rollout released last), else a new one
                    free = self.free.setdefault(name, [])
                    environment = free.pop(0) if free else None
                environment = self.environments[name]() if environment is None else environment
            elif name is not None:
                pool = self.pool[name]
                taken[name] = taken.get(name, 0) + 1
                if len(pool) < taken[name]:
                    pool.append(self.environments[name]())
                environment = pool[taken[name] - 1]
            if environment is not None:
                row = {c: v[i] for c, v in columns.items() if c != ENVIRONMENT_COLUMN or len(self.environments) == 1}
                observation = environment.reset(prompt=prompt, **row)
                if observation is not None:
                    last = prompt[-1]
                    prompts[i] = prompt[:-1] + [{**last, "content": last["content"] + str(observation)}]
            tools = self.tools + (environment_methods(environment) if environment is not None else [])
            environments.append(environment)
            schemas.append([tool_schema(t, t.__name__) for t in tools])
            row_tools.append({t.__name__: t for t in tools})
        return MultiTurn(prompts, environments, schemas, row_tools, owned=owned)

    def release(self, turns: MultiTurn) -> None:
        """A scored rollout's own environments (start(owned=True)) free again, in row order. One whose tool call ran
        past --tool_timeout (and may still be running on it) is never used again: the pool gets a new one."""
        if turns.released:
            return
        abandoned = turns.abandoned or [False] * len(turns.environments)
        with self.lock:
            for environment, left_running in zip(turns.environments, abandoned):
                if environment is None:
                    continue
                if turns.owned and not left_running:
                    self.free.setdefault(type(environment).__name__, []).append(environment)
                elif not turns.owned and left_running:
                    pool = self.pool[type(environment).__name__]
                    for i, pooled in enumerate(pool):
                        if pooled is environment:
                            pool[i] = type(environment)()
        turns.released = True

    def read_rewards(self, turns: MultiTurn) -> None:
        """Each environment class's get_reward on its own rows (None on the others), read as the rollout ends (in the
        queue's thread for a rollout made ahead) into turns.rewards, within --reward_timeout. A failure (or a call past
        the timeout) is kept in its place and raised when the rollout is scored, as a reward function's is."""
        for name, cls in self.environments.items():
            if not hasattr(cls, "get_reward"):
                continue

            def read(cls=cls) -> list:
                values = [e.get_reward() if type(e) is cls else None for e in turns.environments]
                pending = [i for i, value in enumerate(values) if inspect.isawaitable(value)]  # an async get_reward
                for i, value in zip(pending, await_all([values[i] for i in pending])):
                    if isinstance(value, BaseException):
                        raise value
                    values[i] = value
                return values

            try:
                turns.rewards[name] = within(self.reward_timeout, f"reward function {name}", read)
            except Exception as e:
                turns.rewards[name] = e

    def reward_funcs(self) -> list[tuple[str, Callable]]:
        """The environments' get_reward as reward sources, named after their classes (weight 1, as in TRL): each
        scores the rollouts of its own class, None elsewhere, with the values read_rewards kept."""

        def environment_reward(name: str):
            def reward(environment_rewards, **kwargs):
                values = environment_rewards[name]
                if isinstance(values, BaseException):
                    raise values
                return values

            return reward

        return [
            (name, environment_reward(name)) for name, cls in self.environments.items() if hasattr(cls, "get_reward")
        ]


def load_tool_use(
    *,
    tools: Optional[list[str]],
    environment: Optional[list[str]],
    max_tool_calling_iterations: Optional[int],
    tool_timeout: Optional[float],
    reward_timeout: Optional[float],
) -> Optional[ToolUse]:
    """The tools (--tools: functions' specs) and environment classes (--environment) loaded and checked (before any
    model loads), with the rounds of calls a rollout may make and the seconds a call and a get_reward may take (the
    options of those names); None without tools or environments."""
    if not tools and not environment:
        return None
    pool = load_environments(environment or [])
    return ToolUse(
        load_tools(tools or []),
        {name: type(p[0]) for name, p in pool.items()},
        pool,
        max_tool_calling_iterations=max_tool_calling_iterations,
        tool_timeout=tool_timeout,
        reward_timeout=reward_timeout,
    )


def check_tool_template(
    tokenizer,
    first_prompt,
    image_column: Optional[str],
    *,
    stop_token_id: Optional[int],
    chat_template_kwargs: Optional[dict],
    model_name_or_path: str,
) -> None:
    """What multi-turn rollouts need of the prompts and the chat template (check_tool_format), before the policy
    loads: the policy's tokenizer, the dataset's first prompt and its image column (None: text); stop_token_id
    (--stop_token_id), a further token that ends a turn; chat_template_kwargs, the template's own arguments
    (--chat_template_kwargs); model_name_or_path, the model whose template an error names."""
    if isinstance(first_prompt, str):
        raise UsageError(
            "--tools and --environment need chat prompts (a list of messages), which the chat template renders with "
            "the tools' schemas; the prompts here are plain text"
        )
    if image_column is not None:
        raise UsageError("--tools and --environment take text prompts only; these prompts have images")
    stop_ids = [tokenizer.eos_token_id] + ([stop_token_id] if stop_token_id is not None else [])
    check_tool_format(tokenizer, stop_ids, chat_template_kwargs or {}, model_name_or_path)
