"""HF generate's side of sampling, and the prompts: the sampling options and their checks (GenerationOptions, with
what --generation_kwargs may not set), HF's generation configs, the static KV cache and the probe of its compiled step,
a prompt's forward shared by its copies, the end tokens, and the prompts tokenized as TRL does."""

import functools
import json
from dataclasses import dataclass
from typing import Optional

import torch

from rloo_utils.data import left_pad
from rloo_utils.errors import UsageError, describe
from rloo_utils.json_options import JsonObject
from rloo_utils.vision import builds_own_positions, image_prompt_rows


STATIC_CACHE_LINE = "HF generate keeps a static KV cache, its decoding step compiled"


def static_cache(
    cache_implementation: str,
    device: torch.device,
    console,
    weights_dtype: torch.dtype,
    unsupported: Optional[str],
    autocast: bool,
) -> bool:
    """Whether HF generate keeps a static KV cache and compiles its decoding step (cache_implementation,
    --cache_implementation: static, dynamic, or auto: on CUDA, where a step of a small model is otherwise bound by
    Python and kernel launches, not by reading the weights). unsupported: why this run cannot (image prompts; a sharded
    policy's forward; None: nothing known), said in one line if it was meant. Nor can --bf16's autocast over weights of
    another dtype (autocast: whether generation runs under it, weights_dtype the sampling weights'; a copy of the
    policy that samples computes in its own dtype): transformers' static cache is made in the dtype of the first keys
    it holds, and under autocast RoPE gives float32 keys and the projection bfloat16 values (an H200 run failed so). Nor
    can a device that torch.compile cannot build for (no C++ compiler for inductor on a CPU, a GPU that Triton does not
    support): compile_failure finds it now, rather than the first rollout with a traceback of a hundred lines. A static
    cache kept is said in one line (STATIC_CACHE_LINE)."""
    wanted = cache_implementation == "static" or (cache_implementation == "auto" and device.type == "cuda")
    if unsupported is None and autocast and weights_dtype != torch.bfloat16:
        unsupported = (
            f"--bf16 computes in bfloat16 over {str(weights_dtype).removeprefix('torch.')} weights, and transformers' "
            "static cache holds one dtype (--dtype bfloat16 keeps one)"
        )
    if wanted and unsupported is None and (failure := compile_failure(str(device))) is not None:
        unsupported = f"torch.compile cannot build the decoding step on {device} ({failure})"
    if wanted and unsupported:
        console.print(f"HF generate keeps a dynamic KV cache, uncompiled: {unsupported}")
    elif wanted:  # said, so that a run's output tells which cache sampled (the dynamic one, the default, says nothing)
        console.print(STATIC_CACHE_LINE)
    return wanted and not unsupported


def probe_graph(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What compile_failure compiles: a product and a softmax's reductions, which inductor makes a kernel of (C++ on a
    CPU, Triton on a GPU), as it does of a decoding step."""
    return (x @ w).softmax(-1).sum(-1)


@functools.cache
def compile_failure(device: str) -> Optional[str]:
    """None where torch.compile builds and runs a compiled graph on `device` as HF generate compiles its decoding step
    (get_compiled_call: torch.compile with transformers' CompileConfig, inductor in mode reduce-overhead); else why not,
    in one line (`InductorError: InvalidCxxCompiler: No working C++ compiler found ...`). The graph is tiny and run
    three times (CUDA graphs: a warm-up, a recording, a replay), from fixed inputs (the run's random streams are left
    alone). Once per process: it costs the compiler's start-up, which the step's own first compile pays otherwise,
    and ~1 s more (0.06 s where inductor's cache holds it; 2-core CPU)."""
    from transformers.generation.configuration_utils import CompileConfig

    x = torch.linspace(-1, 1, 32, device=device).view(4, 8)
    compiled = torch.compile(probe_graph, **CompileConfig().to_dict())
    try:
        for _ in range(3):
            out = compiled(x, x.T)
        if not torch.allclose(out, probe_graph(x, x.T)):
            return f"the compiled graph computes {out.tolist()}, not {probe_graph(x, x.T).tolist()}"
    except Exception as e:  # InductorError, BackendCompilerFailed, Triton's or the C compiler's errors
        return describe(e)
    return None


# Tokens: a static cache holds the prompts' width rounded up to a multiple of this, and the completion's
CACHE_BUCKET = 64


def static_cache_inputs(ids: torch.Tensor, mask: torch.Tensor, config, largest: int) -> dict:
    """HF generate's inputs for a chunk of (b, P) prompts. With a static cache: b' rows, the b and copies of the last up
    to the next power of two (at most `largest`), whose completions the caller drops; and the cache's length, P rounded
    up to a multiple of CACHE_BUCKET plus the completion's. The compiled decoding step is traced again for each new
    batch size and each new cache length (transformers keeps a cache as long as the longest before it): at most
    (log2(largest) + 2) x ((--max_prompt_length + --max_completion_length) / 64 + 1) times in a run (a tool turn's
    context holds earlier turns), usually a few, whatever the number of rows of a round or a turn and the prompts'
    lengths. Without: the rows as they are."""
    if config.cache_implementation != "static":
        return {"input_ids": ids, "attention_mask": mask}
    rows = min(1 << (len(ids) - 1).bit_length(), max(largest, len(ids)))
    copies = rows - len(ids)
    return {
        "input_ids": torch.cat([ids, ids[-1:].expand(copies, -1)]),
        "attention_mask": torch.cat([mask, mask[-1:].expand(copies, -1)]),
        "max_cache_len": -(-ids.shape[1] // CACHE_BUCKET) * CACHE_BUCKET + config.max_new_tokens,
    }


def generation_configs(
    stop_ids: list[int],
    pad_token_id: int,
    never_sampled: Optional[list[int]] = None,
    static: bool = False,
    *,
    max_completion_length: int,
    temperature: float,
    eval_temperature: Optional[float],
    filters: "SamplingFilters",
):
    """HF generate's configs: sampling (at temperature, with the filters), greedy (the sample tables), and the
    evaluation's (sampling at eval_temperature; None: temperature; 0: greedy); each of at most max_completion_length
    new tokens (the options of those names). A completion ends only at stop_ids, and holds none of never_sampled (a
    VLM's image tokens). static
    (static_cache): a static KV cache (static_cache_inputs sizes it) and the decoding step compiled (transformers'
    CompileConfig: CUDA graphs on a GPU), the dynamic cache's completions (tests/test_static_cache.py)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    cache = {}
    if static:
        compile_config = CompileConfig()
        compile_config._compile_all_devices = True  # --cache_implementation static on a CPU compiles too
        cache = {"cache_implementation": "static", "compile_config": compile_config}

    greedy = GenerationConfig(
        max_new_tokens=max_completion_length,
        do_sample=False,
        eos_token_id=stop_ids,
        pad_token_id=pad_token_id,
        suppress_tokens=never_sampled or None,
        **cache,
    )
    sampling, evaluation = (
        GenerationConfig(
            max_new_tokens=max_completion_length,
            min_new_tokens=0,
            do_sample=True,
            temperature=t,
            top_p=filters.top_p,
            top_k=filters.top_k,
            min_p=filters.min_p,
            repetition_penalty=filters.repetition_penalty,
            eos_token_id=stop_ids,
            pad_token_id=pad_token_id,
            suppress_tokens=never_sampled or None,
            **cache,
            **(filters.generation_kwargs or {}),
        )
        if t != 0
        else greedy  # the evaluation's, at --eval_temperature 0
        for t in (temperature, temperature if eval_temperature is None else eval_temperature)
    )
    return sampling, greedy, evaluation


def shared_prompt_cache(model, prompt_ids, prompt_mask, copies: int, config):
    """For rows that hold each text prompt `copies` times in a row (the evaluation's n completions of a prompt): the KV
    cache of the prompts' tokens but the last, made by one forward of each prompt and copied to each of its rows, which
    HF generate takes as past_key_values and extends by the last prompt token and the completion. The prompt's forward
    is then made once, not `copies` times (at 64 rows of 4 copies, generate takes a fifth less time). None where there
    is nothing to share, or the model builds its own positions or the config its own cache."""
    if copies == 1 or len(prompt_ids) % copies or prompt_ids.shape[1] < 2 or config.cache_implementation is not None:
        return None
    if builds_own_positions(model):
        return None
    ids, mask = prompt_ids[::copies, :-1], prompt_mask[::copies, :-1]  # (b / copies, P - 1)
    with torch.no_grad():
        cache = model(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0), use_cache=True
        ).past_key_values
    cache.batch_repeat_interleave(copies)
    return cache


@dataclass(frozen=True)
class SamplingFilters:
    """Which tokens a completion's sampling may draw, and how likely (GenerationOptions' options of these names)."""

    top_p: float
    top_k: int
    min_p: Optional[float]
    repetition_penalty: float
    generation_kwargs: Optional[dict]


@dataclass
class GenerationOptions:
    """Prompts in, completions out: the prompts' length and chat template; besides the temperature, how completions are
    sampled and where they stop (HF's GenerationConfig; rloo_vllm.py: vLLM's SamplingParams)"""

    max_prompt_length: int = 256
    """longer prompts keep their last tokens (and their BOS), counted in `prompts/truncated`"""
    chat_template_kwargs: JsonObject = None
    """arguments of the chat template of conversational prompts, as JSON: '{"enable_thinking": false}' for Qwen3"""
    top_p: float = 1.0
    """nucleus sampling"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    min_p: Optional[float] = None
    """min-p sampling: only tokens at least min_p times as likely as the likeliest one (None: off)"""
    repetition_penalty: float = 1.0
    """> 1 makes tokens already in the prompt or completion less likely (Keskar et al. 2019; 1: off)"""
    generation_kwargs: JsonObject = None
    """more sampling options as JSON, for HF's GenerationConfig (rloo_vllm.py: vLLM's SamplingParams), as in TRL"""
    stop_token_id: Optional[int] = None
    """a further token id that ends a completion (kept, like EOS; everything after it is padding)"""
    ignore_eos: bool = False
    """sample max_completion_length tokens whatever comes (old TRL without --stop_token eos)"""

    def filters(self) -> SamplingFilters:
        """The sampler's filters: top_p, top_k, min_p, repetition_penalty and generation_kwargs."""
        return SamplingFilters(
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            generation_kwargs=self.generation_kwargs,
        )

    def check(self) -> None:
        """The sampler's filters and stop token; --generation_kwargs, which must not set what an option or the rollout
        sets, tried on HF generate where it samples (vLLM's SamplingParams: vllm_options.check_vllm_args); and
        --chat_template_kwargs, which must not set what the prompt's tokenization does."""
        if self.stop_token_id is not None and self.stop_token_id < 0:
            raise UsageError(f"--stop_token_id must be a token id (>= 0), got {self.stop_token_id}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise UsageError(f"--min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise UsageError(f"--repetition_penalty must be > 0 (1: none), got {self.repetition_penalty}")
        for key in self.generation_kwargs or {}:
            if key in OWN_SAMPLING_OPTIONS:
                raise UsageError(
                    f"--generation_kwargs sets {key}, which {OWN_SAMPLING_OPTIONS[key]} sets: use that option"
                )
            if key in RESERVED_SAMPLING_OPTIONS:
                raise UsageError(
                    f"--generation_kwargs sets {key}, which the rollout sets itself (one sampled completion per "
                    "row, as token ids with their log-probs): leave it out"
                )
            if key in TEXT_SAMPLING_OPTIONS:
                raise UsageError(
                    f"--generation_kwargs sets {key}, which works on text, but the rollout samples token ids "
                    "without decoding them: end completions with --stop_token_id, or score them in a reward function"
                )
        if self.generation_kwargs and not self.samples_with_vllm():
            from transformers import GenerationConfig

            known = GenerationConfig().to_dict()
            unknown = sorted(set(self.generation_kwargs) - set(known))
            if unknown:
                raise UsageError(
                    f"--generation_kwargs: {', '.join(unknown)} is not an option of transformers' GenerationConfig "
                    "(rloo.py and rloo_multigpu.py generate with HF generate; vLLM's SamplingParams options go to "
                    "rloo_vllm.py)"
                )
            try_generation_kwargs(self.generation_kwargs)
        reserved = sorted(set(self.chat_template_kwargs or {}) & CHAT_TEMPLATE_CALL_ARGUMENTS)
        if reserved:
            raise UsageError(
                f"--chat_template_kwargs sets {', '.join(reserved)}, an argument of apply_chat_template that "
                "the prompt's tokenization sets itself: give only the template's own variables (e.g. "
                "enable_thinking), tools, documents or chat_template"
            )


# Sampling options the scripts set themselves, which --generation_kwargs must not override: the flag to use instead
OWN_SAMPLING_OPTIONS = {
    "temperature": "--temperature",
    "top_p": "--top_p",
    "top_k": "--top_k",
    "min_p": "--min_p",
    "repetition_penalty": "--repetition_penalty",
    "max_new_tokens": "--max_completion_length",
    "max_tokens": "--max_completion_length",
    "max_length": "--max_completion_length",
    "eos_token_id": "--stop_token_id",
    "stop_token_ids": "--stop_token_id",
    "ignore_eos": "--ignore_eos",
    "seed": "--seed",
    "n": "--num_generations",
    "num_return_sequences": "--num_generations",
    "cache_implementation": "--cache_implementation",
    "compile_config": "--cache_implementation",
    "max_cache_len": "--cache_implementation",
}


# ...and those that would break the rollout: one sampled completion per row with its log-probs, as token ids
# (min_length keeps EOS from being sampled; max_time cuts completions by the clock, as the machine's load decides)
RESERVED_SAMPLING_OPTIONS = {
    "do_sample",
    "num_beams",
    "num_beam_groups",
    "pad_token_id",
    "suppress_tokens",
    "logprobs",
    "logprob_token_ids",
    "detokenize",
    "min_tokens",
    "min_new_tokens",
    "min_length",
    "max_time",
    "output_kind",
    "logit_bias",
    "return_dict_in_generate",
    "output_scores",
    "output_logits",
    "output_attentions",
    "output_hidden_states",
}


# ...and those that read text, which the rollout does not make (prompts and completions are token ids)
TEXT_SAMPLING_OPTIONS = {"stop", "stop_strings", "bad_words", "structured_outputs", "guided_decoding"}


# apply_chat_template's own arguments (transformers' tokenizers and processors), which a prompt's tokenization sets:
# --chat_template_kwargs passes only what reaches the template (its variables, tools, documents, chat_template)
CHAT_TEMPLATE_CALL_ARGUMENTS = {
    "conversation",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "processor_kwargs",
    "load_audio_from_video",
}


def try_generation_kwargs(generation_kwargs: dict) -> None:
    """--generation_kwargs as HF generate takes them, tried on a one-layer stand-in model (milliseconds) so that a
    value it cannot use (a string where a number belongs, an unknown cache) is one line before the policy loads."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    try:
        generation_config = GenerationConfig(do_sample=True, max_new_tokens=2, pad_token_id=0, **generation_kwargs)
        generation_config.validate(strict=True)
        with torch.random.fork_rng(devices=[]):  # the run's random streams stay as its seed set them
            prompt = torch.ones(1, 2, dtype=torch.long)
            LlamaForCausalLM(config).generate(prompt, attention_mask=prompt, generation_config=generation_config)
    except Exception as e:
        raise UsageError(
            f"--generation_kwargs {json.dumps(generation_kwargs)}: HF generate cannot use it ({describe(e)})"
        ) from None


def end_token_ids(tokenizer, model_eos, stop_token_id: Optional[int], ignore_eos: bool) -> tuple[list[int], list[int]]:
    """(EOS ids, ids that end a completion). The EOS ids are the tokenizer's and every one the model's generation config
    declares (Llama 3: <|eot_id|> and <|end_of_text|>; Qwen: <|im_end|> and <|endoftext|>), as in TRL 1.16. A completion
    ends at any of them, unless ignore_eos, and at --stop_token_id."""
    eos_ids = {tokenizer.eos_token_id} | set([model_eos] if isinstance(model_eos, int) else model_eos or [])
    stop_ids = (set() if ignore_eos else eos_ids) | ({stop_token_id} if stop_token_id is not None else set())
    return sorted(eos_ids), sorted(stop_ids)


def tokenize_prompts(
    tokenizer,
    prompts: list,
    max_prompt_length: int,
    device,
    processor=None,
    images=None,
    chat_template_kwargs: Optional[dict] = None,
    tools: Optional[list[list[dict]]] = None,
):
    """Left-padded (B, P) ids and mask. A string prompt gets the tokenizer's special tokens (a BOS where the model
    expects one, as in TRL); chat messages go through the chat template, which holds them already. A prompt longer
    than max_prompt_length keeps its last tokens, and its BOS. Also returns how many were truncated, and with images
    (a VLM's prompts) per row the processor's image tensors, each placeholder expanded into its image's tokens.
    tools: per row, the schemas of the tools the chat template shows it (--tools, --environment)."""
    if images is not None:
        rows, image_tensors = image_prompt_rows(processor, prompts, images, max_prompt_length, chat_template_kwargs)
        return *(t.to(device) for t in left_pad(rows, tokenizer.pad_token_id)), 0, image_tensors
    rows = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            rows.append(tokenizer(prompt)["input_ids"])
        else:
            template_kwargs = {**(chat_template_kwargs or {}), **({"tools": tools[i]} if tools else {})}
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **template_kwargs)
            rows.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    num_truncated = sum(len(r) > max_prompt_length for r in rows)
    rows = [last_tokens(r, max_prompt_length, tokenizer.bos_token_id) for r in rows]
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    return ids.to(device), mask.to(device), num_truncated, None


def last_tokens(ids: list[int], max_length: int, bos_token_id: Optional[int]) -> list[int]:
    """The last max_length tokens of a prompt, its BOS kept in front (where it has one and there is room)."""
    if len(ids) <= max_length:
        return ids
    if ids[0] == bos_token_id and max_length > 1:
        return ids[:1] + ids[len(ids) - max_length + 1 :]
    return ids[-max_length:]
