"""Rollouts: a Rollout (the value an update trains on), the part of sampling the scripts share (BaseSampler; a script's
sampler says only how it generates), rloo.py's sampler (HF generate: HFSampler), and dynamic sampling (DAPO: an update's
groups whose scores are all equal replaced by groups of prompts drawn anew). The queue of asynchronous rollouts is
rollout_queue.py's."""

import contextlib
import copy
import dataclasses
import functools
import json
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from rloo_utils import decoding
from rloo_utils.data import FirstRoundRows, left_pad, repeated, resampled_prompts
from rloo_utils.generation import (
    end_token_ids,
    generation_configs,
    shared_prompt_cache,
    static_cache,
    static_cache_inputs,
    tokenize_prompts,
)
from rloo_utils.off_policy import refresh_copy, sampler_dtype, sampler_line, sampling_copy
from rloo_utils.packing import rollout_logprobs
from rloo_utils.processes import (
    agreed,
    all_gather_prompts,
    all_reduce,
    gather_rows,
    get_rank,
    get_world_size,
    max_over_processes,
)
from rloo_utils.rewards import task_scores
from rloo_utils.tools import MultiTurn
from rloo_utils.vision import image_token_ids, images_batch, vision_inputs


# ---- A rollout, and how prompts become one -------------------------------------------------------------------------
@dataclass
class Rollout:
    """The completions of some prompts, sampled by the policy (a Sampler's sample): the B rows of an update (each
    prompt's G completions adjacent, so group g is rows [g*G, (g+1)*G)), a sample table's, or a chunk of an
    evaluation's."""

    prompts: list  # (B,) as the dataset holds them: strings, or chat messages
    columns: dict  # the dataset's other columns, B values each: what reward functions get besides the completions
    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, C) padded with the pad token to --max_completion_length
    completion_mask: torch.Tensor  # (B, C) 1 up to and including the stop token
    tool_mask: torch.Tensor  # (B, C) 1 on the tools' results between the model's turns (multi-turn rollouts)
    ended: torch.Tensor  # (B,) whether each completion ended: a stop token came
    num_truncated: int = 0  # how many prompts were cut to --max_prompt_length
    images: Optional[list] = None  # a VLM's prompts: each row's image tensors (images_batch)
    turns: Optional[MultiTurn] = None  # --tools, --environment: the conversations, environments, tool calls
    sampling_logprobs: Optional[torch.Tensor] = None  # (B, C) the sampler's own log-probs (vLLM's); HF generate: None

    def tool_counts(self) -> tuple[int, int, int]:
        """The tool calls, the failed ones, and the completions they are over (0, 0, 0 without tools)."""
        return (self.turns.calls, self.turns.failures, self.turns.completions) if self.turns else (0, 0, 0)

    @property
    def num_tokens(self) -> int:
        """Prompt and completion tokens (TRL 1.16's num_tokens counts them)."""
        return int(self.prompt_mask.sum() + self.completion_mask.sum())

    @property
    def policy_mask(self) -> torch.Tensor:
        """(B, C) the tokens the policy chose (not the tools' results): only they enter the loss and the KL."""
        return (self.completion_mask * (1 - self.tool_mask)).float()

    def to(self, device) -> "Rollout":
        """The rollout with its tensors on `device` (one made in the queue's thread is made on the CPU)."""
        moved = {name: getattr(self, name).to(device) for name in ROLLOUT_TENSORS if getattr(self, name) is not None}
        return dataclasses.replace(self, **moved)

    def state_dict(self) -> Optional[dict]:
        """A multi-turn rollout made ahead, as a checkpoint holds it: its tensors, and its prompts, columns and turns as
        JSON (torch.load takes both with weights_only). None where it cannot be kept whole: rows with environments (the
        user's objects), or values JSON cannot hold."""
        if self.turns is not None and any(e is not None for e in self.turns.environments):
            return None
        plain = {"prompts": self.prompts, "columns": self.columns, "num_truncated": self.num_truncated}
        try:
            text = json.dumps({**plain, "turns": self.turns and self.turns.state_dict()})
        except (TypeError, ValueError):
            return None
        return {"json": text, **{n: getattr(self, n).cpu() for n in ROLLOUT_TENSORS if getattr(self, n) is not None}}

    @staticmethod
    def from_state_dict(state: dict) -> "Rollout":
        plain = json.loads(state["json"])
        turns = plain.pop("turns")
        tensors = {n: state.get(n) for n in ROLLOUT_TENSORS}
        return Rollout(**plain, **tensors, turns=turns and MultiTurn.from_state_dict(turns))


ROLLOUT_TENSORS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "tool_mask",
    "ended",
    "sampling_logprobs",
)


class BaseSampler:
    """Prompts in, a Rollout out: tokenized (a VLM's images beside them), completed in one go or (--tools,
    --environment) turn by turn with the tools' results in between (rloo_utils/tools.py), masked after the first stop
    token. A script's sampler (HFSampler, VLLMSampler, ShardedSampler) derives from this one and says how it generates:
    generate(prompt_ids, prompt_mask, config, images, seeds, copies) -> (B, C) completion ids and (B, C) the sampler's
    log-probs of them (or None), and generate_turn(contexts, budgets, config, seeds) -> a multi-turn rollout's next turn
    (next_turn); one that takes an engine's completions made ahead (the rollout queue's `outputs`) also
    completions(outputs) -> the same two."""

    reads_images_itself = False  # generate takes the dataset's images (vLLM's processor reads them), not the tensors
    # every process makes every turn of a multi-turn rollout, in the training thread: a sharded model's forward, and
    # each turn's agreed() (a failure on one process stops all), are collectives; the queue's thread holds none
    turns_in_step = True
    owns_environments = False  # a multi-turn rollout's environments are its own until scored (the queue's thread's)

    def __init__(
        self,
        models,
        plan,
        stop_ids: list[int],
        eos_ids: list[int],
        device,
        *,
        max_prompt_length: int,
        max_completion_length: int,
        chat_template_kwargs: Optional[dict],
        max_staleness: int = 0,
    ):
        """models: set_up.Models, whose tokenizer and processor tokenize the prompts; plan: set_up.RunPlan, whose
        tool_use and image_column say what a rollout holds; stop_ids: the tokens that end a completion (eos_ids: those
        of them that are EOS); the options of the other names: prompts keep their last max_prompt_length tokens,
        rendered with chat_template_kwargs, and completions are at most max_completion_length tokens; max_staleness:
        rollouts are made ahead, in the rollout queue's thread."""
        self.tokenizer, self.processor, self.device = models.tokenizer, models.processor, device
        self.tool_use, self.image_col, self.stop_ids, self.eos_ids = plan.tool_use, plan.image_column, stop_ids, eos_ids
        self.max_prompt_length, self.max_completion_length = max_prompt_length, max_completion_length
        self.chat_template_kwargs, self.max_staleness = chat_template_kwargs, max_staleness
        # One multi-turn rollout at a time, in the training thread or the queue's: a tool is never called from two
        # threads at once (docs/tools.md)
        self.turns_lock = threading.Lock()
        self.background_sampler = None  # the queue's thread's copy of this sampler (background_rollout)
        # its tokenizer, copied before that thread runs (a copy reads the tokenizer, which must not change meanwhile)
        self.background_tokenizer = copy.deepcopy(self.tokenizer) if self.tool_use and max_staleness else None

    def sample(self, prompts: list, columns: dict, config, seeds=None, copies=1, outputs=None) -> Rollout:
        """The prompts tokenized and completed. seeds: one per row (a sampler's random streams); copies: each prompt's
        rows are that many in a row, whose prompt forward is then made once; outputs: an engine's completions made
        already (per completion: ids and log-probs), or a multi-turn rollout made whole (the rollout queue's)."""
        if isinstance(outputs, Rollout):
            return outputs.to(self.device)
        if self.tool_use:
            with self.turns_lock:
                return self.sample_turns(prompts, columns, config, seeds)
        return self.sample_once(prompts, columns, config, seeds, copies, outputs)

    def background_rollout(self, request: dict) -> Rollout:
        """With --max_staleness and --tools or --environment: the whole multi-turn rollout of a request (environments
        reset, the model's turns, the tools' calls), made in the rollout queue's thread, on the CPU, with a tokenizer
        of its own (a tokenizer is not thread-safe), and without collectives (every process makes its own turns)."""
        if self.background_sampler is None:  # (only the queue's thread makes it)
            self.background_sampler = copy.copy(self)
            self.background_sampler.tokenizer = self.background_tokenizer
            self.background_sampler.device = torch.device("cpu")
            self.background_sampler.turns_in_step, self.background_sampler.owns_environments = False, True
        return self.background_sampler.sample(
            request["prompts"], request["columns"], request["config"], request["seeds"]
        )

    def sample_once(self, prompts: list, columns: dict, config, seeds, copies, outputs) -> Rollout:
        """Completions in one go (sample without tools)."""
        prompt_ids, prompt_mask, num_truncated, images = tokenize_prompts(
            self.tokenizer,
            prompts,
            self.max_prompt_length,
            self.device,
            self.processor,
            columns.get(self.image_col),
            self.chat_template_kwargs,
        )  # (B, P)
        if outputs is None:
            generation_images = columns.get(self.image_col) if self.reads_images_itself else images
            completion_ids, sampling_logprobs = self.generate(
                prompt_ids, prompt_mask, config, generation_images, seeds, copies
            )  # (B, C), (B, C) or None
        else:
            completion_ids, sampling_logprobs = self.completions(outputs)
        completion_mask, ended = completion_mask_from(completion_ids, self.stop_ids, self.eos_ids)  # (B, C), (B,)
        return Rollout(
            prompts=prompts,
            columns=columns,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            tool_mask=torch.zeros_like(completion_mask),
            ended=ended,
            num_truncated=num_truncated,
            images=images,
            sampling_logprobs=sampling_logprobs,
        )

    def sample_turns(self, prompts: list, columns: dict, config, seeds) -> Rollout:
        """The model's turns, and the tools' results between them (rloo_utils/tools.py)."""
        tokenizer, tool_use = self.tokenizer, self.tool_use
        turns = tool_use.start(prompts, columns, self.owns_environments)  # environments reset; each row's tools
        prompt_ids, prompt_mask, num_truncated, _ = tokenize_prompts(
            tokenizer,
            turns.prompts,
            self.max_prompt_length,
            self.device,
            chat_template_kwargs=self.chat_template_kwargs,
            tools=turns.schemas,
        )  # (B, P)
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]  # without padding
        generate_turn = functools.partial(self.next_turn, config=config, seeds=seeds)
        turns.generate(
            generate_turn,
            rows,
            tokenizer,
            self.stop_ids,
            max_completion_length=self.max_completion_length,
            max_tool_calling_iterations=tool_use.max_tool_calling_iterations,
            tool_timeout=tool_use.tool_timeout,
            chat_template_kwargs=self.chat_template_kwargs,
            in_step=self.turns_in_step,
        )
        tool_use.read_rewards(turns)  # the environments' get_reward, as the rollout ends
        completion_ids, completion_mask, tool_mask, ended, sampling_logprobs = turns.tensors(
            tokenizer.pad_token_id, self.device
        )  # (B, C) each, (B,)
        return Rollout(
            prompts=prompts,
            columns=columns,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            tool_mask=tool_mask,
            ended=ended,
            num_truncated=num_truncated,
            turns=turns,
            sampling_logprobs=sampling_logprobs,
        )

    def seeds_for(self, update: int, round_: int, num_rows: int) -> Optional[list[int]]:
        """One seed per row of an update's rollout (its round_-th under --dynamic_sampling), for a sampler that seeds
        each completion (vLLM's); None: HF generate draws from torch's generator, which a checkpoint keeps."""
        return None

    def next_turn(self, contexts: list[list[int]], budgets: list[int], rows: list[int], round_: int, config, seeds):
        """A multi-turn rollout's next model turn after each context (its prompt, and its turns and tool results so
        far), for MultiTurn.generate: the script's generate_turn gives the ids up to and including the first stop token,
        at most the row's budget of them, with the sampler's log-probs (or None). seeds: each row's, for its first turn;
        a later turn's is drawn from it (turn_seed)."""
        turn_seeds = None if seeds is None else [turn_seed(seeds[row], round_) for row in rows]
        return self.generate_turn(contexts, budgets, config, turn_seeds)

    def turn_length(self, budgets: list[int]) -> int:
        """The most tokens a turn may generate: its rows' largest budget, the same on every process whose turns are in
        step. Under synced_gpus a process whose rows have ended goes on stepping with the others, and a static KV
        cache sized for its own shorter turn would overflow (a process whose rollouts have all ended makes a 1-token
        turn)."""
        return max_over_processes(max(budgets)) if self.turns_in_step else max(budgets)


def turn_seed(seed: int, round_: int) -> int:
    """The seed of a multi-turn rollout's turn after `round_` rounds of tool calls, from its row's seed: the first
    turn's is the row's own (a rollout without calls samples what a single-turn one does), a later one's a function of
    both (a resumed run draws what the uninterrupted run drew)."""
    return seed if round_ == 0 else int(np.random.SeedSequence([seed, round_]).generate_state(1)[0])


def completion_mask_from(completion_ids: torch.Tensor, stop_ids: list[int], eos_ids: list[int]):
    """(B, C) mask that keeps tokens up to and including the first stop token; (B,) whether the completion ended:
    a stop token came, or (when EOS does not stop it, --ignore_eos) it holds an EOS."""
    is_stop = torch.isin(completion_ids, torch.tensor(stop_ids, dtype=torch.long, device=completion_ids.device))
    stopped = is_stop.any(1)
    first_stop = torch.where(stopped, is_stop.int().argmax(1), completion_ids.shape[1])
    mask = torch.arange(completion_ids.shape[1], device=completion_ids.device)[None] <= first_stop[:, None]
    holds_eos = (torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device)) & mask).any(1)
    return mask.long(), stopped | holds_eos


def rows_of_rollouts(pieces: list[tuple[Rollout, list[int]]], pad_token_id: int) -> Rollout:
    """The chosen rows of several rollouts as one (--dynamic_sampling's rounds), in order: prompts left-padded to the
    longest, completions right-padded; the truncated prompts and the tools' counts of every row sampled."""
    index = [torch.tensor(rows, dtype=torch.long) for _, rows in pieces]

    def rows_of(name: str, left: bool = False, value: float = 0) -> torch.Tensor:
        parts = [getattr(rollout, name)[i.to(getattr(rollout, name).device)] for (rollout, _), i in zip(pieces, index)]
        width = max(t.shape[1] for t in parts)
        return torch.cat(
            [F.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=value) for t in parts]
        )

    first = pieces[0][0]
    return Rollout(
        prompts=[rollout.prompts[i] for rollout, rows in pieces for i in rows],
        columns={c: [rollout.columns[c][i] for rollout, rows in pieces for i in rows] for c in first.columns},
        prompt_ids=rows_of("prompt_ids", left=True, value=pad_token_id),
        prompt_mask=rows_of("prompt_mask", left=True),
        completion_ids=rows_of("completion_ids", value=pad_token_id),
        completion_mask=rows_of("completion_mask"),
        tool_mask=rows_of("tool_mask"),
        ended=torch.cat([rollout.ended[i.to(rollout.ended.device)] for (rollout, _), i in zip(pieces, index)]),
        num_truncated=sum(rollout.num_truncated for rollout, _ in pieces),
        images=None if first.images is None else [rollout.images[i] for rollout, rows in pieces for i in rows],
        turns=None if first.turns is None else MultiTurn.gather([(rollout.turns, rows) for rollout, rows in pieces]),
        sampling_logprobs=None if first.sampling_logprobs is None else rows_of("sampling_logprobs"),
    )


# ---- rloo.py's sampler: HF generate ----------------------------------------------------------------------------------
class HFSampler(BaseSampler):
    """Prompts in, a Rollout out (BaseSampler tokenizes, runs the tools' turns, masks): the policy, or a copy of it in
    bfloat16 (--sampler_weights), completes them with HF generate, in one go or, with --tools or --environment, turn
    by turn. rloo.py's; rloo_vllm.py's is VLLMSampler (vllm_sampling.py), rloo_multigpu.py's ShardedSampler."""

    def __init__(
        self,
        policy,
        models,
        plan,
        stop_ids,
        eos_ids,
        device,
        autocast,
        own_loop=False,
        *,
        forward_batch_size: int,
        temperature: float,
        **limits,
    ):
        """policy: the model that samples; autocast(): its forwards' (a copy in bfloat16: none); own_loop: decoding.py's
        loop where it covers the inputs (use_own_loop), else HF generate's; forward_batch_size: the rows of one
        generate and of one log-prob forward (--local_rollout_forward_batch_size); temperature: the log-probs'
        (--temperature); the rest: BaseSampler's (limits: the prompts' and completions' lengths, the template's
        arguments)."""
        super().__init__(models, plan, stop_ids, eos_ids, device, **limits)
        self.policy, self.autocast, self.own_loop = policy, autocast, own_loop
        self.forward_batch_size, self.temperature = forward_batch_size, temperature
        self.trained, self.logprobs_of, self.configs = policy, None, None  # (for_run's)

    @classmethod
    def for_run(cls, args, models, plan, device, autocast, console, logprobs_of) -> "HFSampler":
        """The run's sampler: HF generate on the policy, or on a copy of it in bfloat16 refreshed after each update
        (--sampler_weights; auto: under --bf16 over float32 weights on CUDA), as inference engines do: the compiled
        decoding step needs one dtype. Its configs: sampling, greedy (the sample tables), the evaluation's."""
        policy, tokenizer = models.policy, models.tokenizer
        eos_ids, stop_ids = end_token_ids(
            tokenizer, policy.generation_config.eos_token_id, args.stop_token_id, args.ignore_eos
        )
        copy_dtype = sampler_dtype(args.sampler_weights, policy.dtype, args.bf16, device, args.use_peft)
        sampling_policy = policy if copy_dtype is None else sampling_copy(policy, copy_dtype)
        console.print(sampler_line(policy.dtype, copy_dtype))
        unsupported = "image prompts" if plan.image_column else None  # HF generate's static cache: not with these
        static = static_cache(
            args.cache_implementation,
            device,
            console,
            sampling_policy.dtype,
            unsupported,
            args.bf16 and copy_dtype is None,
        )
        never_sampled = image_token_ids(policy.config)  # a VLM's image tokens: a completion holds none
        configs = generation_configs(
            stop_ids,
            tokenizer.pad_token_id,
            never_sampled,
            static,
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            eval_temperature=args.eval_temperature,
            filters=args.filters(),
        )
        own_loop = decoding.use_own_loop(args.decoding_loop, static, sampling_policy, configs, console)  # or HF's
        sampler_autocast = autocast if copy_dtype is None else contextlib.nullcontext  # a copy computes in its dtype
        sampler = cls(
            sampling_policy,
            models,
            plan,
            stop_ids,
            eos_ids,
            device,
            sampler_autocast,
            own_loop,
            forward_batch_size=args.local_rollout_forward_batch_size,
            temperature=args.temperature,
            max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length,
            chat_template_kwargs=args.chat_template_kwargs,
        )
        sampler.trained, sampler.logprobs_of, sampler.configs = policy, logprobs_of, configs
        return sampler

    def rollout_done(self, rollout: Rollout, timer) -> None:
        """Sampling is over for this update. Where a copy of the policy in other numerics sampled (--sampler_weights):
        its log-probs of the rollout, the gap between sampler and trainer, logged and weighed by the off-policy
        correction as vLLM's is."""
        if self.policy is not self.trained:
            with timer("sampler_logprobs"):
                rollout.sampling_logprobs = rollout_logprobs(
                    self.policy,
                    rollout,
                    self.logprobs_of,
                    contextlib.nullcontext,
                    self.forward_batch_size,
                    self.temperature,
                )  # (B, C)

    def sync_weights(self, timer) -> None:
        """After an update: the copy that samples (--sampler_weights) holds the updated policy, in place."""
        if self.policy is not self.trained:
            with timer("weight_sync"):
                refresh_copy(self.policy, self.trained)

    def generate(self, prompt_ids, prompt_mask, config, images=None, seeds=None, copies=1):
        """(B, C) completion ids, padded with the pad token to --max_completion_length, in chunks of
        --local_rollout_forward_batch_size, and None: HF generate gives no log-probs (the policy's forward does). With
        seeds, each chunk samples from the seed of its first row. copies: the rows hold each prompt that many times in
        a row, whose forward is then made once (shared_prompt_cache)."""
        model, chunk = self.policy, self.forward_batch_size
        model.eval()
        chunks = []
        for i in range(0, len(prompt_ids), chunk):
            rows = slice(i, i + chunk)
            if seeds is not None:
                torch.manual_seed(seeds[i])
            with torch.no_grad(), self.autocast():
                shared = None  # the prompt's forward made once for its copies
                if images is None:
                    shared = shared_prompt_cache(model, prompt_ids[rows], prompt_mask[rows], copies, config)
                inputs = dict(
                    **static_cache_inputs(prompt_ids[rows], prompt_mask[rows], config, chunk),  # (b', P)
                    past_key_values=shared,
                    generation_config=config,
                    **vision_inputs(model, prompt_ids[rows], images_batch(images, rows, self.device, model.dtype)),
                )
                own = self.own_loop and decoding.covers(model, **inputs)  # rloo_utils/decoding.py's loop
                generate = functools.partial(decoding.generate, model) if own else model.generate
                out = generate(**inputs)[: len(prompt_ids[rows])]
            padding = self.max_completion_length - out.shape[1] + prompt_ids.shape[1]
            chunks.append(F.pad(out[:, prompt_ids.shape[1] :], (0, padding), value=self.tokenizer.pad_token_id))
        return torch.cat(chunks), None

    def generate_turn(self, contexts: list[list[int]], budgets: list[int], config, seeds=None) -> list[tuple]:
        """The next turn after each context: at most its budget of ids, up to and including the first stop token (and
        no log-probs: the policy's own forward gives them). seeds: each context's."""
        context_ids, context_mask = (t.to(self.device) for t in left_pad(contexts, self.tokenizer.pad_token_id))
        config = copy.deepcopy(config)
        config.max_new_tokens = max(budgets)
        turn_ids, _ = self.generate(context_ids, context_mask, config, None, seeds)  # (b, C)
        turn_mask, _ = completion_mask_from(turn_ids, self.stop_ids, self.eos_ids)
        return [(ids[: min(int(m.sum()), b)].tolist(), None) for ids, m, b in zip(turn_ids, turn_mask, budgets)]


def gather_rollout(rollout: Rollout, pad_token_id: int) -> Rollout:
    """rloo_multigpu.py: the rollout of every process, in rank order, on each (B rows): the prompts padded alike, the
    completions, masks, ends and sampler's log-probs; the truncated prompts counted over all. Its images and multi-turn
    record stay this process's own."""
    prompt_ids, prompt_mask = all_gather_prompts(rollout.prompt_ids, rollout.prompt_mask, pad_token_id)
    return dataclasses.replace(
        rollout,
        prompt_ids=prompt_ids,  # (B, P)
        prompt_mask=prompt_mask,
        **{name: gather_rows(getattr(rollout, name)) for name in ["completion_ids", "completion_mask", "tool_mask"]},
        ended=gather_rows(rollout.ended),  # (B,)
        num_truncated=int(all_reduce(torch.tensor(rollout.num_truncated))),
        sampling_logprobs=None if rollout.sampling_logprobs is None else gather_rows(rollout.sampling_logprobs),
    )


def varied_groups(scores: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(num_groups,) whether each group of G adjacent scores holds two scored ones (not NaN) that differ: a group
    without has advantage 0 under every group baseline (DAPO's filter, Yu et al. 2025, Eq. 11: 0 < #correct < G)."""
    s = scores.view(-1, num_generations)  # (num_groups, G); NaN (unscored) is neither the highest nor the lowest
    return s.nan_to_num(-torch.inf).amax(1) > s.nan_to_num(torch.inf).amin(1)


class DynamicSampling:
    """--dynamic_sampling (DAPO, Yu et al. 2025, section 3.2): an update's groups whose scores are all equal are dropped
    and prompts drawn anew (data.resampled_prompts: none the update drew before, while others remain) are sampled and
    scored in their place, a round at a time, each round as many prompts as groups are still missing (so no completion
    is generated to be thrown away for want of room; with processes, as many as the process that misses most), until
    the update holds its number of groups or --max_sampling_rounds rounds have run; then the places still missing take
    the last dropped groups, trained on as without dynamic sampling. Decided on the score (rewards.task_scores: the
    reward sources and the EOS penalty), not the reward with its KL penalty, under which almost no group is uniform."""

    def __init__(
        self, sampler: BaseSampler, scorer, dataset, num_generations: int, max_rounds: int, seed: int, penalty
    ):
        self.sampler, self.scorer, self.dataset, self.config = sampler, scorer, dataset, sampler.configs[0]  # sampling
        self.num_generations, self.max_rounds, self.seed, self.missing_eos_penalty = (
            num_generations,
            max_rounds,
            seed,
            penalty,
        )
        self.first_round_rows = FirstRoundRows(len(dataset), seed)

    def refill(self, rollout: Rollout, rewards_per_func, scores, completions: list[str], update: int, timer):
        """The update's first round (sampled, scored: (B, F) rewards, (B,) scores) -> the rollout of the kept groups,
        their (B, F) rewards, (B,) scores and decoded completions, and the metrics of what was sampled (sampling/*, over
        every process). Every round's generation counts to the update's time/generation (and time/resampling), its
        scoring to time/reward."""
        G = self.num_generations
        num_groups = len(rollout.prompts) // G
        rounds = [(rollout, rewards_per_func, scores, completions)]  # per round: rollout, (b, F), (b,), completions
        kept, dropped = [], []  # (round, group) in the order sampled: the groups with varied scores the update takes
        # groups sampled, of them uniform; the scores' sum and number; the policy's tokens
        counts = torch.zeros(5, dtype=torch.float64)
        drawn = set(self.first_round_rows(update, num_groups * get_world_size()))  # the rows later rounds skip
        while True:
            piece, _, scores, _ = rounds[-1]
            varied = varied_groups(scores, G).tolist()
            counts += torch.tensor(
                [len(varied), varied.count(False), scores.nansum(), (~scores.isnan()).sum(), piece.policy_mask.sum()],
                dtype=torch.float64,
            )
            for group, is_varied in enumerate(varied):
                (kept if is_varied and len(kept) < num_groups else dropped).append((len(rounds) - 1, group))
            missing = max_over_processes(num_groups - len(kept))  # every process samples every round: a collective
            if missing == 0 or len(rounds) >= self.max_rounds:
                break
            batch = resampled_prompts(
                self.dataset, missing, self.seed, update, len(rounds), get_rank(), get_world_size(), drawn
            )
            prompts, columns = repeated(batch, G)
            seeds = self.sampler.seeds_for(update, len(rounds), len(prompts))
            with timer("generation"), timer("resampling"):
                piece = self.sampler.sample(prompts, columns, self.config, seeds)
            with timer("reward"), agreed():  # a reward function that raises on one process stops all of them
                piece_rewards, piece_completions = self.scorer.score(piece)
            piece_scores = task_scores(piece_rewards, self.scorer.weights, piece.ended, self.missing_eos_penalty)
            rounds.append((piece, piece_rewards, piece_scores, piece_completions))

        # the kept groups, and where rounds ran out the last dropped ones, in the order of their rounds
        short = num_groups - len(kept)
        rows = [[] for _ in rounds]  # per round: the rows the update takes
        for round_, group in kept + (dropped[len(dropped) - short :] if short else []):
            rows[round_] += range(group * G, (group + 1) * G)
        offsets = np.cumsum([0] + [len(piece.prompts) for piece, *_ in rounds]).tolist()
        self.scorer.logs.keep_rows([offsets[r] + i for r, taken in enumerate(rows) for i in taken], offsets[-1])
        result = rows_of_rollouts(
            [(piece, taken) for (piece, *_), taken in zip(rounds, rows)], self.sampler.tokenizer.pad_token_id
        )
        result_rewards = torch.cat([r[taken] for (_, r, _, _), taken in zip(rounds, rows)])  # (B, F)
        result_scores = torch.cat([s[taken] for (_, _, s, _), taken in zip(rounds, rows)])  # (B,)
        result_completions = [texts[i] for (*_, texts), taken in zip(rounds, rows) for i in taken]

        # what was sampled, over every process
        counts = torch.cat(
            [counts, torch.tensor([len(kept), short, float(result.policy_mask.sum())], dtype=torch.float64)]
        )
        if dist.is_initialized():
            counts = all_reduce(counts.to(rollout.completion_ids.device)).cpu()
        sampled, uniform, score_sum, num_scores, tokens, num_kept, num_short, tokens_taken = counts.tolist()
        metrics = {
            "sampling/rounds": len(rounds),
            "sampling/groups_sampled": sampled,
            "sampling/groups_zero_std": uniform,  # dropped: all their scores equal
            "sampling/frac_groups_zero_std": uniform / sampled,  # of every group sampled
            "sampling/groups_kept": num_kept,
            "sampling/groups_short": num_short,  # places the rounds left unfilled: taken by dropped groups
            "sampling/score_mean": score_sum / max(num_scores, 1),  # every sampled completion's: the policy's own
            "sampling/generated_tokens": tokens,  # the policy's tokens of every round
            "sampling/discarded_tokens": tokens - tokens_taken,  # of them, those not trained on
        }
        return result, result_rewards, result_scores, result_completions, metrics
