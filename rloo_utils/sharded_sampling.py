"""rloo_multigpu.py's sampler (ShardedSampler): HF generate on the FSDP-sharded policy, every process in each sharded
forward, or a vLLM server (--vllm_server_host) sent the policy's shards gathered one tensor at a time."""

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rloo_utils import decoding
from rloo_utils.data import left_pad, text_prompts
from rloo_utils.generation import (
    end_token_ids,
    generation_configs,
    shared_prompt_cache,
    static_cache,
    static_cache_inputs,
    tokenize_prompts,
)
from rloo_utils.processes import agreed, whole
from rloo_utils.rollouts import BaseSampler, Rollout, completion_mask_from
from rloo_utils.sharded import gathered
from rloo_utils.vision import image_token_ids, images_batch, vision_inputs
from rloo_utils.vllm_sampling import (
    EngineRequests,
    SHARED_SERVER,
    check_engine,
    pad_completions,
    sampling_configs,
    sampling_seeds,
    unpadded,
)
from rloo_utils.weight_transfer import weights_for_vllm


class ShardedSampler(EngineRequests, BaseSampler):
    """rloo_multigpu.py's sampler. Prompts in, a Rollout out (BaseSampler tokenizes, runs the tools' turns, masks): this
    process's rows, completed by the policy with HF generate (every process in each sharded forward) or by a vLLM
    server, in one go or, with --tools or --environment, turn by turn (with HF generate every process makes every turn:
    a sharded forward is a collective). With --max_staleness the rollout queue asks the server for an update's
    completions (or multi-turn rollouts) ahead (request, then background_outputs in its thread); sample() takes them."""

    def __init__(
        self,
        policy,
        server,
        models,
        plan,
        stop_ids,
        eos_ids,
        device,
        own_loop=False,
        *,
        forward_batch_size: int,
        gather_for_generation: bool,
        num_generations: int,
        seed: int,
        **limits,
    ):
        """policy: the sharded policy; server: a VLLMServer that generates instead (None: HF generate); own_loop:
        decoding.py's loop where it covers the inputs; forward_batch_size: the rows of one generate
        (--local_rollout_forward_batch_size); gather_for_generation: the model gathered whole for it
        (--gather_for_generation); num_generations: the completions of each prompt (G); seed: what a server's seeds are
        drawn from; the rest: BaseSampler's (limits: the prompts' and completions' lengths, the template's arguments,
        max_staleness)."""
        super().__init__(models, plan, stop_ids, eos_ids, device, **limits)
        self.policy, self.engine, self.own_loop = policy, server, own_loop
        self.forward_batch_size, self.gather_for_generation = forward_batch_size, gather_for_generation
        self.num_generations, self.seed = num_generations, seed
        self.reads_images_itself = server is not None  # a server takes the dataset's images; HF generate the tensors
        self.trained, self.logprobs_of, self.configs = policy, None, None  # (for_run's)

    @classmethod
    def for_run(cls, args, models, plan, device, autocast, console, logprobs_of, server) -> "ShardedSampler":
        """The run's sampler: HF generate on the sharded policy, or a vLLM server (made before the run claimed its
        folders), sent the policy's weights now (a resumed run's are the checkpoint's) and after every update, and
        checked against the policy's greedy log-probs (check_engine) before training and after each rollout. Its
        configs: sampling, greedy (the sample tables), the evaluation's; for a server, vLLM's sampling parameters."""
        policy, tokenizer, world_size = models.policy, models.tokenizer, dist.get_world_size()
        eos_ids, stop_ids = end_token_ids(
            tokenizer, policy.generation_config.eos_token_id, args.stop_token_id, args.ignore_eos
        )
        never_sampled = image_token_ids(policy.config)  # a VLM's image tokens: a completion holds none
        unsupported = "image prompts" if plan.image_column else None  # HF generate's static cache: not with these
        if world_size > 1 and not args.gather_for_generation:
            unsupported = "the sharded policy generates (--no_gather_for_generation)"
        # Under --bf16 FSDP's mixed precision gathers the weights in bfloat16, and generation computes in that one
        # dtype: what rloo.py's bfloat16 copy of the policy gives (--sampler_weights), without a copy
        sampling_dtype = torch.bfloat16 if args.bf16 else policy.dtype
        static = server is None and static_cache(
            args.cache_implementation, device, console, sampling_dtype, unsupported, autocast=False
        )
        sampling = dict(
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            eval_temperature=args.eval_temperature,
            filters=args.filters(),
        )
        configs = generation_configs(stop_ids, tokenizer.pad_token_id, never_sampled, static, **sampling)
        if server is not None:  # vLLM's sampling parameters for the same semantics
            configs = sampling_configs(stop_ids, never_sampled, **sampling)
        in_step = "the processes decode in step (synced_gpus)" if world_size > 1 else None
        own_loop = decoding.use_own_loop(args.decoding_loop, static, policy, configs, console, in_step)  # or HF's
        sampler = cls(
            policy,
            server,
            models,
            plan,
            stop_ids,
            eos_ids,
            device,
            own_loop,
            forward_batch_size=args.local_rollout_forward_batch_size,
            gather_for_generation=args.gather_for_generation,
            num_generations=args.num_generations,
            seed=args.seed,
            max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length,
            chat_template_kwargs=args.chat_template_kwargs,
            max_staleness=args.max_staleness,
        )
        sampler.autocast, sampler.logprobs_of, sampler.configs = autocast, logprobs_of, configs
        if server is not None:
            server.push_weights(policy, weights_for_vllm(policy, server.dtype, whole))
            prompts = text_prompts(plan.train_dataset[:2]["prompt"])
            sampler.probe = tokenize_prompts(tokenizer, prompts, args.max_prompt_length, device)[:2]
            check_engine(server, *sampler.probe, configs[1], sampler.greedy_logprobs)
        return sampler

    def rollout_done(self, rollout: Rollout, timer) -> None:
        """Sampling is over for this update: a server is checked again, briefly: it still holds this run's weights, no
        other run pushed its own."""
        if self.engine is not None:
            with timer("engine_check"):
                recheck = {**self.configs[1], "max_tokens": min(8, self.max_completion_length)}  # short
                check_engine(self.engine, *self.probe, recheck, self.greedy_logprobs, SHARED_SERVER)

    def sync_weights(self, timer) -> None:
        """After an update: a server gets the updated policy's weights, gathered one tensor at a time."""
        if self.engine is not None:
            with timer("weight_sync"):
                self.engine.push_weights(self.trained, weights_for_vllm(self.trained, self.engine.dtype, whole))

    def generate(self, prompt_ids, prompt_mask, config, images=None, seeds=None, copies=1):
        """(b, C) completion ids, padded to --max_completion_length, and (b, C) the sampler's log-probs of them (the
        server's, one seed per completion; None from HF generate). HF generate runs in chunks, each sampling from the
        seed of its first row, so that a rollout does not depend on the number of processes; the sharded model's
        forward is a collective: with synced_gpus a process whose completions have all ended goes on with the others.
        images: the rows' image tensors for HF generate; the rows' images as the dataset holds them for the server.
        copies: the rows hold each prompt that many times in a row, whose forward is then made once
        (shared_prompt_cache; only with the model gathered: a sharded forward is a collective)."""
        model, device, pad_token_id = self.policy, self.device, self.tokenizer.pad_token_id
        if self.engine is not None:
            with agreed():  # a request that fails on one process stops every process
                outputs = self.engine.generate(unpadded(prompt_ids, prompt_mask), config, seeds, images)
            return self.completions(outputs)
        model.eval()
        chunks, chunk, world_size = [], self.forward_batch_size, dist.get_world_size()
        with gathered(model, self.gather_for_generation):
            for i in range(0, len(prompt_ids), chunk):
                with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    if seeds is not None:
                        torch.manual_seed(seeds[i])
                    rows = slice(i, i + chunk)
                    shared = None  # the prompt's forward made once for its copies (a gathered model's forward only)
                    if images is None and (self.gather_for_generation or world_size == 1):
                        shared = shared_prompt_cache(model, prompt_ids[rows], prompt_mask[rows], copies, config)
                    inputs = dict(
                        **static_cache_inputs(prompt_ids[rows], prompt_mask[rows], config, chunk),  # (b', P)
                        past_key_values=shared,
                        generation_config=config,
                        synced_gpus=world_size > 1,
                        **vision_inputs(model, prompt_ids[rows], images_batch(images, rows, device, model.dtype)),
                    )
                    own = self.own_loop and decoding.covers(model, **inputs)  # rloo_utils/decoding.py's loop
                    generate = functools.partial(decoding.generate, model) if own else model.generate
                    out = generate(**inputs)[: len(prompt_ids[rows])]
                padding = self.max_completion_length - out.shape[1] + prompt_ids.shape[1]
                chunks.append(F.pad(out[:, prompt_ids.shape[1] :], (0, padding), value=pad_token_id))
        return torch.cat(chunks), None

    def completions(self, outputs: list[tuple[list[int], list[float]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, C) completion ids padded to --max_completion_length and (b, C) their log-probs, from the server's outputs
        (one that a process cannot read stops every process)."""
        length, pad_token_id = self.max_completion_length, self.tokenizer.pad_token_id
        with agreed():
            return pad_completions(outputs, length, pad_token_id, self.stop_ids, self.device)

    def generate_turn(self, contexts: list[list[int]], budgets: list[int], config, seeds=None) -> list[tuple]:
        """The next turn after each context: at most its budget of ids, up to and including the first stop token, with
        the server's log-probs (None from HF generate). seeds: each context's."""
        context_ids, context_mask = (t.to(self.device) for t in left_pad(contexts, self.tokenizer.pad_token_id))
        if self.engine is not None:
            config = {**config, "max_tokens": max(budgets)}
        else:
            config = copy.deepcopy(config)
            config.max_new_tokens = self.turn_length(budgets)  # every process's turn as long: synced_gpus
        turn_ids, turn_logprobs = self.generate(context_ids, context_mask, config, None, seeds)  # (b, C)
        turn_mask, _ = completion_mask_from(turn_ids, self.stop_ids, self.eos_ids)
        lengths = [min(int(m.sum()), budget) for m, budget in zip(turn_mask, budgets)]
        return [
            (ids[:n].tolist(), None if turn_logprobs is None else turn_logprobs[i, :n].tolist())
            for i, (ids, n) in enumerate(zip(turn_ids, lengths))
        ]

    def seeds_for(self, update: int, round_: int, num_rows: int) -> list[int]:
        """This process's rows' seeds: of the global batch's, a function of (--seed, update, round, row), so a resumed
        run draws what the uninterrupted one drew."""
        first, batch_size = dist.get_rank() * num_rows, num_rows * dist.get_world_size()  # this process's rows
        return sampling_seeds(self.seed, update, batch_size, round_)[first : first + num_rows]
