"""What vLLM samples, whichever engine draws it (a colocated one, rloo_utils/vllm_colocated.py, or a server,
rloo_utils/vllm_server.py): the sampling parameters of a run's options, the seeds of its completions, the tokens its
sampler can draw; the prompts as an engine takes them and its completions as tensors; and the check that an engine
samples from the policy (check_engine); rloo_vllm.py's sampler (VLLMSampler)."""

import math
from typing import Callable, Optional

import numpy as np
import torch

from rloo_utils.data import repeated, text_prompts
from rloo_utils.errors import RunError, UsageError
from rloo_utils.generation import SamplingFilters, end_token_ids, tokenize_prompts
from rloo_utils.processes import agreed
from rloo_utils.rollouts import BaseSampler, Rollout
from rloo_utils.vision import image_token_ids
from rloo_utils.vllm_colocated import ColocatedVLLM
from rloo_utils.vllm_options import SERVER_COMMAND
from rloo_utils.weight_transfer import weights_for_vllm


def sampling_configs(
    stop_ids: list[int],
    never_sampled: Optional[list[int]] = None,
    *,
    max_completion_length: int,
    temperature: float,
    eval_temperature: float,
    filters: SamplingFilters,
) -> tuple[dict, dict, dict]:
    """vLLM's sampling parameters of a run, as generation.generation_configs makes HF's: sampling (at temperature, with
    the filters), greedy (the sample tables), and the evaluation's (at eval_temperature, --eval_temperature with its
    default resolved; 0: greedy); each of at most max_completion_length tokens (sampling_options)."""
    sampling = dict(
        max_completion_length=max_completion_length,
        top_p=filters.top_p,
        top_k=filters.top_k,
        min_p=filters.min_p,
        repetition_penalty=filters.repetition_penalty,
        generation_kwargs=filters.generation_kwargs,
    )
    return (
        sampling_options(stop_ids, False, never_sampled, temperature=temperature, **sampling),
        sampling_options(stop_ids, True, never_sampled, temperature=temperature, **sampling),
        sampling_options(stop_ids, eval_temperature == 0, never_sampled, temperature=eval_temperature, **sampling),
    )


def sampling_options(
    stop_ids: list[int],
    greedy: bool,
    never_sampled: Optional[list[int]] = None,
    *,
    max_completion_length: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: Optional[float],
    repetition_penalty: float,
    generation_kwargs: Optional[dict],
) -> dict:
    """vLLM's sampling parameters for HF generate's semantics (rloo.py's): at most max_completion_length tokens, only
    stop_ids end a completion (vLLM's own EOS handling is off, the EOS ids being in stop_ids unless --ignore_eos), the
    stop token is kept, the sampled token's log-prob is returned, after temperature (the engine's logprobs_mode is
    processed_logprobs), and never_sampled (a VLM's image tokens) get vLLM's lowest logit bias, -100. Sampled at
    temperature with the filters top_p, top_k, min_p (None: off), repetition_penalty and generation_kwargs (the
    options of those names); greedy: none of these."""
    sampling = (
        {"temperature": 0.0}
        if greedy
        else {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p or 0.0,
            "repetition_penalty": repetition_penalty,
            **(generation_kwargs or {}),
        }
    )
    return {
        **sampling,
        "max_tokens": max_completion_length,
        "min_tokens": 0,
        "stop_token_ids": stop_ids,
        "ignore_eos": True,
        "logprobs": 0,
        **({"logit_bias": {i: -100.0 for i in never_sampled}} if never_sampled else {}),
    }


def sampler_support(top_k: int, top_p: float, min_p: Optional[float]) -> Optional[Callable]:
    """The tokens vLLM's sampler can draw, as a function of (k, V) fp32 logits already divided by the temperature
    giving a (k, V) bool mask; None where it can draw any token. As vllm/v1/sample: min-p after the temperature
    (MinPLogitsProcessor), then top-k (ties kept), then top-p over what top-k kept (apply_top_k_top_p). vLLM's
    log-probs (processed_logprobs) are renormalised over these tokens: the off-policy correction compares the
    trainer's log-probs on the same distribution."""
    if not top_k and top_p >= 1 and not min_p:
        return None

    def support(logits: torch.Tensor) -> torch.Tensor:
        kept = torch.ones_like(logits, dtype=torch.bool)
        if min_p:
            probs = logits.softmax(-1)
            kept &= probs >= min_p * probs.amax(-1, keepdim=True)
        if top_k and top_k < logits.shape[-1]:
            kth_largest = logits.masked_fill(~kept, -math.inf).topk(top_k, -1).values[:, -1:]
            kept &= logits >= kth_largest
        if top_p < 1:
            ascending, order = logits.masked_fill(~kept, -math.inf).sort(-1)
            tail = ascending.softmax(-1).cumsum(-1) <= 1 - top_p  # the least likely tokens that hold at most 1 - p
            tail[:, -1] = False  # the likeliest token always stays
            kept &= ~torch.zeros_like(kept).scatter(-1, order, tail)
        return kept

    return support


def sampling_seeds(seed: int, update: int, n: int, round_: int = 0) -> list[int]:
    """One seed per completion, a function of (--seed, update, row) only: the samples do not depend on what the engine
    did before, so a resumed run draws what the uninterrupted run drew. The seeds are consecutive, base + row: the G
    completions of prompt g (rows g*G ... g*G+G-1) are then what one request for G completions (n=G) seeded base + g*G
    draws, since vLLM seeds the i-th completion of such a request with seed + i (vllm/v1/engine/parallel_sampling.py);
    that request is how a server gets them (VLLMServer.generate). Distinct seeds, so a group's completions differ.
    round_: --dynamic_sampling's rounds after the first, each a stream of its own."""
    entropy = [seed, update] + ([round_] if round_ else [])
    base = int(np.random.SeedSequence(entropy).generate_state(1)[0])  # < 2**32: what a CPU torch.Generator keeps
    return [base + row for row in range(n)]


def unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's token ids without its padding: what an engine is given."""
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def pad_completions(
    outputs: list[tuple[list[int], list[float]]], length: int, pad_token_id: int, stop_ids: list[int], device
):
    """(B, C) completion ids padded with pad_token_id, and (B, C) sampling log-probs padded with 0. A completion may
    end early only at one of stop_ids (else the engine applied stop rules of its own, and the mask would be wrong)."""
    ids = torch.full((len(outputs), length), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros(len(outputs), length)
    for i, (row_ids, row_logprobs) in enumerate(outputs):
        if len(row_ids) < length and (not row_ids or row_ids[-1] not in stop_ids):
            raise RunError(
                f"vLLM ended a completion at token {row_ids[-1] if row_ids else None}, which is not an end "
                f"token ({stop_ids}): a server must be started with --generation-config vllm ({SERVER_COMMAND})"
            )
        ids[i, : len(row_ids)] = torch.tensor(row_ids[:length], dtype=torch.long)
        logprobs[i, : len(row_logprobs)] = torch.tensor(row_logprobs[:length])
    return ids.to(device), logprobs.to(device)


WRONG_MODEL = "a server must serve --model_name_or_path (or a model of the same architecture and vocabulary)"


SHARED_SERVER = (
    "its weights changed after this run's push: another run sends weights to the same server (a server "
    "serves one run at a time: start one per run)"
)


def check_engine(
    engine,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    options: dict,
    logprobs_of,
    cause: str = WRONG_MODEL,
    tolerance: float = 0.5,
) -> None:
    """After the first push: the engine's greedy log-probs of a few prompts must be the policy's (up to the numerics of
    two implementations), else it is not sampling from the policy: a server serving another model, or a push that did
    not reach every weight (cause: what the error then says). After each rollout from a server: another run pushing its
    weights to the same server. logprobs_of gives the policy's at temperature 1, as vLLM's sampler reports a greedy
    request's (it divides by a temperature only where it samples: vllm/v1/sample/sampler.py), whatever --temperature."""
    prompts = unpadded(prompt_ids, prompt_mask)
    with agreed():  # several processes ask and find the same gap: they stop together (logprobs_of may be a collective)
        with agreed():  # a request that fails on one process stops all of them before the policy's forward
            outputs = engine.generate(prompts, options, None)
        completion_ids, sampling_logprobs = pad_completions(
            outputs, options["max_tokens"], 0, options["stop_token_ids"], prompt_ids.device
        )  # (n, C)
        lengths = torch.tensor([len(ids) for ids, _ in outputs], device=prompt_ids.device)
        completion_mask = (torch.arange(completion_ids.shape[1], device=prompt_ids.device) < lengths[:, None]).long()
        with torch.no_grad():
            gap = (
                (logprobs_of(prompt_ids, prompt_mask, completion_ids, completion_mask) - sampling_logprobs).abs()
                * completion_mask
            ).sum() / completion_mask.sum().clamp(min=1)
        if gap > tolerance:
            raise UsageError(
                f"the vLLM engine does not sample from the policy: its log-probs differ from the policy's "
                f"by {float(gap):.3g} per token (at most {tolerance} expected); {cause}"
            )


# ---- rloo_vllm.py's sampler
# -------------------------------------------------------------------------------------------
class EngineRequests:
    """What the samplers of an engine (VLLMSampler; rloo_multigpu.py's ShardedSampler with a server) share: the policy's
    greedy log-probs the engine check compares with, and what the rollout queue asks of them (request; with
    --max_staleness, background_outputs in its thread). self.engine: the engine or the server."""

    def greedy_logprobs(self, *rollout):
        """The policy's log-probs of the engine's greedy completions, as vLLM reports them, through the training
        forward (its autocast)."""
        with torch.no_grad(), self.autocast():
            return self.logprobs_of(self.trained, *rollout, temperature=1.0)

    def request(self, batches, config, update: int) -> dict:
        """What the rollout of an update samples: the next batch's prompts, each repeated G times (its completions
        adjacent, so group g is rows [g*G, (g+1)*G)), their columns, the seeds and the sampling parameters (config);
        with --max_staleness also the prompts' token ids, tokenized here: the queue generates in a thread of its own,
        and a tokenizer is not thread-safe (a multi-turn rollout's are tokenized there, by a copy of its own)."""
        prompts, columns = repeated(next(batches), self.num_generations)
        seeds = self.seeds_for(update, 0, len(prompts))
        request = {"prompts": prompts, "columns": columns, "seeds": seeds, "config": config}
        if self.max_staleness and not self.tool_use:
            prompt_ids, prompt_mask = tokenize_prompts(
                self.tokenizer,
                prompts,
                self.max_prompt_length,
                self.device,
                self.processor,
                columns.get(self.image_col),
                self.chat_template_kwargs,
            )[:2]
            request["token_ids"] = unpadded(prompt_ids, prompt_mask)
        return request

    def background_outputs(self, request: dict):
        """With --max_staleness, vLLM's completions of a rollout, or (--tools, --environment) the whole multi-turn
        rollout, made in the queue's thread; else None: sample() generates them when the update takes its rollout."""
        if not self.max_staleness:
            return None
        if self.tool_use:
            return self.background_rollout(request)
        return self.engine.generate(
            request["token_ids"], request["config"], request["seeds"], request["columns"].get(self.image_col)
        )


class VLLMSampler(EngineRequests, BaseSampler):
    """rloo_vllm.py's sampler. Prompts in, a Rollout out (BaseSampler tokenizes, runs the tools' turns, masks): vLLM
    completes them (an engine in this process, or a server), in one go or, with --tools or --environment, turn by turn;
    a VLM's images go as the dataset holds them (vLLM's own processor reads them). With --max_staleness the rollout
    queue asks for an update's completions (or multi-turn rollouts) ahead (request, then background_outputs in its
    thread), and sample() takes them."""

    reads_images_itself = True

    def __init__(
        self,
        engine,
        models,
        plan,
        stop_ids,
        eos_ids,
        device,
        *,
        colocated: bool,
        num_generations: int,
        seed: int,
        **limits,
    ):
        """engine: a ColocatedVLLM (colocated: it sleeps after sampling) or a VLLMServer (checked again after sampling);
        num_generations: the completions of each prompt (G); seed: what each completion's seed is drawn from
        (sampling_seeds); the rest: BaseSampler's (limits: the prompts' and completions' lengths, the template's
        arguments, max_staleness)."""
        super().__init__(models, plan, stop_ids, eos_ids, device, **limits)
        self.engine, self.colocated, self.num_generations, self.seed = engine, colocated, num_generations, seed
        self.trained, self.logprobs_of, self.configs = None, None, None  # (for_run's)

    @classmethod
    def for_run(cls, args, models, plan, device, autocast, console, logprobs_of, server) -> "VLLMSampler":
        """The run's sampler: vLLM's engine in this process, or the server (made before the run claimed its folders),
        sent the policy's weights now (a resumed run's are the checkpoint's) and after every update, and checked against
        the policy's greedy log-probs (check_engine) before training and after each rollout, so that a weight push that
        did not arrive stops the run. Its configs: vLLM's sampling parameters for sampling, greedy (the sample tables)
        and the evaluation."""
        policy, tokenizer = models.policy, models.tokenizer
        eos_ids, stop_ids = end_token_ids(
            tokenizer, policy.generation_config.eos_token_id, args.stop_token_id, args.ignore_eos
        )
        never_sampled = image_token_ids(policy.config)  # a VLM's image tokens: a completion holds none
        sampler = cls(
            server or ColocatedVLLM(args, policy, device, models.processor),
            models,
            plan,
            stop_ids,
            eos_ids,
            device,
            colocated=server is None,
            num_generations=args.num_generations,
            seed=args.seed,
            max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length,
            chat_template_kwargs=args.chat_template_kwargs,
            max_staleness=args.max_staleness,
        )
        sampler.trained, sampler.autocast, sampler.logprobs_of = policy, autocast, logprobs_of
        sampler.configs = sampling_configs(
            stop_ids,
            never_sampled,
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            eval_temperature=args.eval_temperature,
            filters=args.filters(),
        )
        sampler.engine.push_weights(policy, weights_for_vllm(policy, sampler.engine.dtype))
        prompts = text_prompts(plan.train_dataset[:2]["prompt"])
        sampler.probe = tokenize_prompts(tokenizer, prompts, args.max_prompt_length, device)[:2]
        check_engine(sampler.engine, *sampler.probe, sampler.configs[1], sampler.greedy_logprobs)
        return sampler

    def rollout_done(self, rollout: Rollout, timer) -> None:
        """Sampling is over for this update: a colocated engine sleeps (sleep mode, as in TRL), its memory free for the
        forwards and the update; a server is checked again, briefly: it still holds this run's weights, no other run
        pushed its own."""
        if self.colocated:
            self.engine.sleep()
        else:
            with timer("engine_check"):
                recheck = {**self.configs[1], "max_tokens": min(8, self.max_completion_length)}  # short
                check_engine(self.engine, *self.probe, recheck, self.greedy_logprobs, SHARED_SERVER)

    def sync_weights(self, timer) -> None:
        """After an update: the engine gets the updated policy's weights."""
        with timer("weight_sync"):
            self.engine.push_weights(self.trained, weights_for_vllm(self.trained, self.engine.dtype))

    def generate(self, prompt_ids, prompt_mask, config, images=None, seeds=None, copies=1):
        """(B, C) completion ids, padded with the pad token to --max_completion_length, and (B, C) vLLM's log-probs of
        them. images: each row's, as the dataset holds them. copies: vLLM caches a prompt's forward itself."""
        return self.completions(self.engine.generate(unpadded(prompt_ids, prompt_mask), config, seeds, images))

    def completions(self, outputs: list[tuple[list[int], list[float]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C) completion ids padded to --max_completion_length and (B, C) their log-probs, from vLLM's outputs."""
        length, pad_token_id = self.max_completion_length, self.tokenizer.pad_token_id
        return pad_completions(outputs, length, pad_token_id, self.stop_ids, self.device)

    def generate_turn(self, contexts: list[list[int]], budgets: list[int], config, seeds=None) -> list[tuple]:
        """The next turn after each context: at most its budget of ids, up to and including the first stop token, with
        vLLM's log-probs. seeds: each context's."""
        outputs = self.engine.generate(contexts, {**config, "max_tokens": max(budgets)}, seeds)
        pad_completions(outputs, max(budgets), self.tokenizer.pad_token_id, self.stop_ids, self.device)  # each ended
        return [(ids[:budget], logprobs[:budget]) for (ids, logprobs), budget in zip(outputs, budgets)]

    def seeds_for(self, update: int, round_: int, num_rows: int) -> list[int]:
        """Each row's seed: a function of (--seed, update, round, row), so a resumed run draws what the uninterrupted
        one drew."""
        return sampling_seeds(self.seed, update, num_rows, round_)
