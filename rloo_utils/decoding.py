"""Our own decoding loop for HF generate's static-cache case (--decoding_loop own): the prompts' forward into
transformers' StaticCache, then one compiled step per token, the last token's forward and the choice of the next,
whose outputs stay on the device; the host reads whether every row has ended only every CHECK_EVERY steps. HF
generate's loop (`_sample`) reads `unfinished_sequences.max() == 0` on the host at every step and runs its logits
processors and `torch.multinomial` outside the compiled forward: a host round-trip and a dozen small launches a token.

`generate(model, ...)` returns what `model.generate(...)` returns (the prompts, then the completions, a row padded
with the pad token after its stop token, as many columns as the longest completion), so that a Sampler calls either.
It runs greedy decoding and sampling with temperature, top_k, top_p, min_p and suppress_tokens, applied as
transformers' logits processors apply them; `covers` says where a config or call asks for more (HF generate then).
Greedy completions are HF generate's token for token; sampled ones are other draws of the same distribution, one
uniform number a row against the cumulative probabilities where HF calls multinomial (tests/test_decoding.py)."""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

# Steps between two reads of whether every row has ended: the only host round-trips of the loop. A chunk whose rows have
# all ended runs at most this many steps too many (their tokens are pads, dropped).
CHECK_EVERY = 16

# The fields of a GenerationConfig the loop runs; every other one must change nothing (None, or its no_op_values value),
# or HF generate runs.
RUNS = {
    *("do_sample", "temperature", "top_k", "top_p", "min_p", "suppress_tokens", "max_new_tokens", "max_length"),
    *("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id", "transformers_version"),
    *("cache_implementation", "max_cache_len", "compile_config", "use_cache", "_from_model_config"),
}


@functools.cache
def no_op_values() -> dict:
    """Each field's value that changes nothing: transformers' defaults, which generate fills in where neither the config
    nor the model's generation config sets a field, and the values a config spells out for the same."""
    from transformers import GenerationConfig

    return {
        **GenerationConfig._get_default_generation_params(),
        **dict(min_new_tokens=0, guidance_scale=1.0, disable_compile=False, is_assistant=False, use_mtp=False),
        **dict(output_attentions=False, output_hidden_states=False, output_logits=False, low_memory=False),
        **dict(token_healing=False, renormalize_logits=False),
    }


def effective_config(model, generation_config):
    """The config generate runs, made by generate's own method: generation_config, then the model's generation config
    where it leaves a field None, then transformers' defaults (top_k 50 where nothing sets it: the filter applies)."""
    return model._prepare_generation_config(generation_config)[0]


def uncovered(model, generation_config, **generate_kwargs) -> Optional[str]:
    """Why generate(model, generation_config=..., **generate_kwargs) would not give what model.generate would, in a few
    words; None where it would. generate_kwargs: the rest of model.generate's arguments, as a Sampler passes them."""
    config = effective_config(model, generation_config)
    if config.cache_implementation != "static":
        return f"cache_implementation {config.cache_implementation!r}: the loop is for the static cache"
    if config.do_sample and not config.temperature:
        return f"do_sample with temperature {config.temperature}"
    if config.eos_token_id is None:
        return "no eos_token_id"
    no_op = no_op_values()
    for name, value in config.to_dict().items():
        if name not in RUNS and value is not None and value != no_op.get(name):
            return f"{name} {value!r}"
    for name, value in generate_kwargs.items():
        if name not in ("input_ids", "attention_mask", "max_cache_len") and value is not None and value is not False:
            return f"{name} given to generate"  # past_key_values, synced_gpus, a VLM's pixel_values
    if getattr(model.config, "vision_config", None) is not None or model.config.is_encoder_decoder:
        return f"a {type(model).__name__}: a decoder-only text model only"
    text_config = model.config.get_text_config(decoder=True)
    if set(getattr(text_config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return f"layers {sorted(set(text_config.layer_types))}: full attention only (one static cache's mask)"
    return None


def covers(model, generation_config, **generate_kwargs) -> bool:
    """Whether generate(model, ...) gives what model.generate(...) gives for these arguments: a decoder-only text
    model, the static cache, and none of what the loop does not run (repetition_penalty != 1, another logits
    processor or stopping criterion from --generation_kwargs or the model's generation config, past_key_values,
    synced_gpus, a VLM's inputs). The Sampler calls HF generate where it does not."""
    return uncovered(model, generation_config, **generate_kwargs) is None


def use_own_loop(option: str, static: bool, model, configs: list, console, unsupported: Optional[str] = None) -> bool:
    """Whether HFSampler decodes with this loop (--decoding_loop; auto: HF generate's, until a GPU has measured
    ours): with a static cache (static_cache), for a run whose configs (sampling, greedy, the evaluation's) it covers.
    Where `own` was asked and cannot be (no static cache, a config asking for more, `unsupported`: rloo_multigpu.py's
    processes decoding in step), one line says why and HF generate decodes."""
    if option != "own":
        return False
    why = unsupported or (None if static else "HF generate keeps a dynamic cache here (--cache_implementation)")
    if why is None:
        why = next(filter(None, (uncovered(model, config) for config in configs)), None)
    if why:
        console.print(f"--decoding_loop own: HF generate's loop decodes ({why})")
    return why is None


@dataclass(frozen=True)
class Choice:
    """How the next token is chosen from a step's logits: greedy (the most likely) or sampled, after the filters of
    transformers' logits processors. Its fields are constants of the compiled step (one graph per run's config)."""

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: Optional[float]
    suppressed: Optional[torch.Tensor]  # ids never chosen (a VLM's image tokens)

    @classmethod
    def of(cls, config, device) -> "Choice":
        suppressed = None
        if config.suppress_tokens:
            suppressed = torch.tensor(config.suppress_tokens, device=device)
        if not config.do_sample:  # greedy reads no filter: every greedy config one graph
            return cls(False, 1.0, 0, 1.0, None, suppressed)
        top_p = 1.0 if config.top_p is None else config.top_p
        return cls(True, config.temperature, config.top_k or 0, top_p, config.min_p, suppressed)


def next_tokens(logits: torch.Tensor, choice: Choice) -> torch.Tensor:
    """(b,) the ids chosen from (b, V) float32 logits. In the order of transformers' processors: suppress_tokens, then
    (sampling only) temperature, top_k, top_p, min_p, each as its LogitsProcessor computes it (ties kept alike)."""
    if choice.suppressed is not None:
        logits = logits.index_fill(-1, choice.suppressed, -float("inf"))
    if not choice.do_sample:
        return logits.argmax(-1)
    logits = logits / choice.temperature
    if choice.top_k:
        kth = torch.topk(logits, min(choice.top_k, logits.shape[-1]))[0][:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if choice.top_p < 1.0:  # the tokens past top_p of the probability, counted from the least likely; the top one kept
        ascending, order = torch.sort(logits)
        removed = ascending.softmax(-1).cumsum(-1) <= 1 - choice.top_p
        removed[:, -1] = False
        logits = logits.masked_fill(removed.scatter(1, order, removed), -float("inf"))
    if choice.min_p is not None:
        probs = logits.softmax(-1)
        removed = probs < choice.min_p * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(removed.scatter(1, probs.argmax(-1, keepdim=True), False), -float("inf"))
    # A draw of the categorical: the first token whose cumulative probability reaches a uniform number in (0, total].
    # One random number a row (multinomial's draw, which a compiled graph cannot hold); float64 sums, so that 150k
    # probabilities add up to their last digits; a token of probability 0 adds nothing and is never reached.
    cumulative = logits.softmax(-1).double().cumsum(-1)
    uniform = (1 - torch.rand(len(logits), 1, dtype=torch.float64, device=logits.device)) * cumulative[:, -1:]
    return (cumulative < uniform).sum(-1)


def decoding_step(model, cache, tokens, positions, mask, unfinished, stop_ids, pad_token_id: int, choice: Choice):
    """One token of every row: the forward of `tokens` (b,) at `positions` (b,), writing their keys and values into the
    static cache, and the next tokens; an ended row (not `unfinished`) gets the pad token, as in HF generate. Returns
    the next tokens, their positions and which rows go on. Compiled (compiled_step), all of it on the device."""
    logits = model(
        input_ids=tokens[:, None], attention_mask=mask, position_ids=positions[:, None], past_key_values=cache
    ).logits[:, -1]
    chosen = torch.where(unfinished, next_tokens(logits.float(), choice), pad_token_id)
    return chosen, positions + 1, unfinished & ~torch.isin(chosen, stop_ids)


@functools.cache
def compiled_step():
    """decoding_step compiled as HF generate compiles its forward (transformers' CompileConfig: inductor, mode
    reduce-overhead, so CUDA graphs on a GPU)."""
    from transformers.generation.configuration_utils import CompileConfig

    return torch.compile(decoding_step, **CompileConfig().to_dict())


@torch.no_grad()
def generate(model, input_ids, attention_mask, generation_config, max_cache_len: Optional[int] = None, **absent):
    """(b, P + n) ids: the (b, P) left-padded prompts and n tokens of each, what model.generate(input_ids,
    attention_mask, generation_config=..., max_cache_len=...) returns. absent: generate's other arguments, each None or
    False (covers)."""
    from transformers import StaticCache

    why = uncovered(model, generation_config, **absent)
    if why is not None:
        raise ValueError(f"decoding.generate does not run this generate call ({why}): call model.generate")
    config = effective_config(model, generation_config)
    prompt_length = input_ids.shape[1]
    new_tokens = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt_length
    stop_ids = torch.tensor(config.eos_token_id, device=input_ids.device).view(-1)
    pad_token_id = config.pad_token_id if config.pad_token_id is not None else int(stop_ids[0])
    choice = Choice.of(config, input_ids.device)
    cache_length = max(max_cache_len or 0, config.max_cache_len or 0, prompt_length + new_tokens)
    cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=cache_length)

    # The prompts' forward, uncompiled (one shape a call), positions counting real tokens as HF generate's do
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        **({"logits_to_keep": 1} if model._supports_logits_to_keep() else {}),
    ).logits[:, -1]
    tokens = next_tokens(logits.float(), choice)
    unfinished = ~torch.isin(tokens, stop_ids)
    generated = [tokens]
    # Every step's mask is the whole cache's: the prompts' padding masked, the slots after it open (the causal mask
    # hides those not yet written), so that each step has the same inputs' shapes and one graph serves them all.
    mask = F.pad(attention_mask, (0, cache_length - prompt_length), value=1)
    positions = positions[:, -1] + 1
    step = compiled_step()
    for n in range(1, new_tokens):
        if n % CHECK_EVERY == 0 and not unfinished.any():  # the host waits for the device here only
            break
        torch.compiler.cudagraph_mark_step_begin()  # this step's CUDA graph may reuse the last one's outputs' memory
        tokens, positions, unfinished = step(
            model, cache, tokens, positions, mask, unfinished, stop_ids, pad_token_id, choice
        )
        generated.append(tokens.clone())  # kept: the next step's graph overwrites its outputs
    completions = torch.stack(generated, 1)  # (b, n)
    return torch.cat([input_ids, completions[:, : generated_length(completions, stop_ids)]], 1)


def generated_length(completions: torch.Tensor, stop_ids: torch.Tensor) -> int:
    """How many tokens HF generate would have made of these (b, n): it stops after the step in which the last row
    ended, and at n where a row has not."""
    ends = torch.isin(completions, stop_ids)
    if not ends.any(1).all():
        return completions.shape[1]
    return int(ends.int().argmax(1).max()) + 1
