"""Padding-free forwards: the real tokens of a micro-batch packed into rows, positions restarting per sequence; where an
attention kernel cannot keep packed sequences apart, padded forwards (probed once at start). The output layer's inputs,
from which the log-probs are made a chunk at a time."""

import contextlib
import functools
import itertools
import math
from typing import Callable, Optional

import torch
import torch.utils.checkpoint

from rloo_utils.errors import UsageError, describe
from rloo_utils.lora import transformers_model
from rloo_utils.vision import builds_own_positions, vision_inputs

# Attention implementations that keep packed sequences apart in any number of rows: transformers' mask utilities build
# a block-causal mask per row from position ids that restart at 0. Any other (flash attention's varlen kernels, which
# read each sequence's start from the position ids) gets the whole micro-batch in one row.
PACKED_ROWS = ("eager", "sdpa", "flex_attention")


@torch.no_grad()
def packing_layout(
    model, wanted: bool, images: bool, console, name: str, autocast=contextlib.nullcontext
) -> Optional[str]:
    """How pack_sequences lays out the padding-free forwards of `model` (a causal LM, or a reward model's backbone):
    "rows", "one_row", or None for padded forwards: with image prompts, for a family whose positions are its own, and
    where packing_probe finds a packed sequence computed otherwise than alone. Said in one line when it falls back."""
    if not wanted or model is None:
        return None
    config = transformers_model(model).config
    implementation = config._attn_implementation or "eager"
    why = (
        "image prompts are not packed"
        if images
        else "its positions are its own (mrope)"
        if builds_own_positions(model)
        else None
    )
    if why is None and (failure := packing_probe(model, config.get_text_config().vocab_size, autocast)):
        model_class = type(transformers_model(model)).__name__.removeprefix("FSDP")
        why = f"with attention {implementation!r}, {model_class} {failure}"
    if why:
        console.print(f"{name}: padded forwards, not padding-free: {why}")
        return None
    return "rows" if implementation in PACKED_ROWS else "one_row"


def packing_probe(model, vocab_size: int, autocast) -> Optional[str]:
    """What goes wrong when `model` runs a sequence packed after another, as the training forwards will (under their
    autocast; a causal LM's output-layer inputs caught by output_layer_inputs), or None: its outputs must not change
    with the tokens of the sequence before it (OPT's mask, for one, ignores position ids), and must be those of the
    sequence alone."""
    device = next(model.parameters()).device
    ids = torch.arange(1, 17, device=device) % vocab_size  # (16,): a front sequence of 5 tokens, then one of 11
    positions = torch.cat([torch.arange(5), torch.arange(11)]).to(device)[None]
    causal = transformers_model(model).can_generate()  # else a backbone: its hidden states

    def second_sequence(input_ids, position_ids=None):  # (11, H) hidden states
        if not causal:
            with autocast():
                return model(input_ids=input_ids[None], position_ids=position_ids, use_cache=False)[0][0, -11:]
        last_11 = torch.arange(len(input_ids) - 11, len(input_ids), device=device)
        with autocast(), output_layer_inputs(model, last_11) as caught:
            model(input_ids=input_ids[None], position_ids=position_ids, use_cache=False)
        assert caught and caught[0].shape[0] == 11, "its output layer was not given the positions picked"
        return caught[0]

    was_training = model.training
    model.eval()  # no adapter dropout: the forwards must differ only by what they are given
    try:
        packed = second_sequence(torch.cat([ids[:5], ids[5:]]), positions)
        other_front = second_sequence(torch.cat([ids[:5].flip(0), ids[5:]]), positions)
        alone = second_sequence(ids[5:])
    except Exception as e:  # an output layer the pre-hook cannot catch, an attention that refuses position ids...
        return f"fails the packing probe ({describe(e)})"
    finally:
        model.train(was_training)
    scale = float(alone.abs().max())
    if not torch.allclose(packed, other_front, rtol=1e-3, atol=1e-3 * scale):
        return "lets packed sequences see each other"
    if not torch.allclose(packed, alone, rtol=3e-2, atol=3e-2 * scale):  # other shapes: bf16 rounding may differ
        return "computes a packed sequence otherwise than alone"
    return None


def pack_sequences(ids: torch.Tensor, mask: torch.Tensor, layout: str):
    """The real tokens (mask 1) of each row of (B, T) `ids`, as one sequence each, packed into rows with position ids
    restarting at 0 (packing_layout). "rows": first-fit decreasing into rows as long as the longest sequence, so that
    attention costs no more than in padded rows while the other layers see only real tokens (Krell et al. 2021);
    "one_row": all in one row. Returns ids (R, L), position ids (R, L), and each token's (B, T) index into the
    flattened rows (meaningful where mask is 1). A row's free end is filler that follows its last sequence, which
    causal attention keeps from reaching any real token."""
    real = mask.bool()
    lengths = mask.sum(1).tolist()
    L = max(1, sum(lengths) if layout == "one_row" else max(lengths))
    room, start = [], [0] * len(lengths)  # room left in each row; each sequence's start in the flattened rows
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, left in enumerate(room) if left >= lengths[i]), len(room))
        if row == len(room):
            room.append(L)
        start[i], room[row] = row * L + L - room[row], room[row] - lengths[i]
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # (B, T): as position_ids_from gives the padded rows
    index = torch.tensor(start, device=ids.device)[:, None] + positions  # (B, T)
    packed_ids = torch.zeros(len(room) * L, dtype=ids.dtype, device=ids.device).index_put_((index[real],), ids[real])
    packed_positions = (torch.arange(len(room) * L, device=ids.device) % L).index_put_((index[real],), positions[real])
    return packed_ids.view(len(room), L), packed_positions.view(len(room), L), index


def varlen_kwargs(mask: torch.Tensor, layout: str) -> dict:
    """With the one-row layout (flash attention), where each sequence of pack_sequences' row begins and how long the
    longest is, as transformers' flash attention takes them (int32 (N + 1,) cumulative lengths, an int): else it works
    them out from the position ids in every layer, a host sync each. {} for the other layouts (a block mask)."""
    if layout != "one_row":
        return {}
    lengths = sorted((n for n in mask.sum(1).tolist() if n), reverse=True)  # pack_sequences' order: longest first
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=mask.device)
    return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": lengths[0], "max_length_k": lengths[0]}


def row_tokens(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, padding_free: bool) -> torch.Tensor:
    """(B,) what each row of a rollout costs a training forward, in tokens: its real ones where the forward is
    padding-free, else the padded width (P + C) that every row takes."""
    if padding_free:
        return (prompt_mask.sum(1) + completion_mask.sum(1)).long()
    return torch.full((len(prompt_mask),), prompt_mask.shape[1] + completion_mask.shape[1], device=prompt_mask.device)


def micro_batches(rows: torch.Tensor, tokens: torch.Tensor, size: int, max_tokens: Optional[int], agree=None) -> list:
    """A minibatch's rows (indices into the rollout) as micro-batches: `size` rows each, in order; or with max_tokens
    (--max_tokens_per_micro_batch) packed first-fit decreasing into as few as hold at most that many tokens each
    (tokens: row_tokens, by rollout row), so that a step's memory follows the budget, not its longest rows. agree:
    with several processes, the count every process must make (FSDP's forwards are collectives): fewer are split."""
    if max_tokens is None:
        return [rows[i : i + size] for i in range(0, len(rows), size)]
    lengths = tokens[rows].tolist()
    bins, room = [], []  # positions in `rows` per micro-batch, and the tokens each has left
    for i in sorted(range(len(rows)), key=lambda i: -lengths[i]):  # longest first; ties keep the minibatch's order
        b = next((b for b, left in enumerate(room) if left >= lengths[i]), len(bins))
        if b == len(bins):  # (a row longer than the budget, which check_args refuses, would get one of its own)
            bins.append([])
            room.append(max_tokens)
        bins[b].append(i)
        room[b] -= lengths[i]
    count = agree(len(bins)) if agree else len(bins)
    while len(bins) < count:  # split the fullest micro-batch that has two rows: the count is at most the rows
        b = min((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: room[b])
        bins[b], half = bins[b][::2], bins[b][1::2]
        room[b] = max_tokens - sum(lengths[i] for i in bins[b])
        bins.append(half)
        room.append(max_tokens - sum(lengths[i] for i in half))
    return [rows[sorted(b)] for b in bins]


@contextlib.contextmanager
def output_layer_inputs(model, index: torch.Tensor):
    """Catch the hidden states at `index` of the flattened (R, L) rows as they reach the output layer: (K, H), one per
    predicted token, appended to the list this yields. The output layer gets none of them, so the forward makes no
    logits: the caller makes them a chunk of positions at a time (logprobs_through_output_layer)."""
    caught = []

    def catch(module, args):
        hidden = args[0].flatten(0, 1)[index]  # (K, H)
        caught.append(hidden)
        return (hidden[None, :0], *args[1:])  # (1, 0, H): logits of no position

    handle = model.get_output_embeddings().register_forward_pre_hook(catch)
    try:
        yield caught
    finally:
        handle.remove()


def output_layer(model) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """The output layer of a causal LM, and what the model does to its logits before returning them: Gemma's soft
    cap (final_logit_softcapping), Cohere's logit_scale, Granite's logits_scaling; nothing for the others.
    check_output_layer holds a model to it at start."""
    config = transformers_model(model).config.get_text_config()
    scale = float(getattr(transformers_model(model), "logit_scale", None) or 1.0)  # Cohere: logits x logit_scale
    scale /= float(getattr(config, "logits_scaling", None) or 1.0)  # Granite: logits / logits_scaling
    cap = getattr(config, "final_logit_softcapping", None)

    def transform(logits):
        logits = logits * scale if scale != 1.0 else logits
        return cap * torch.tanh(logits / cap) if cap else logits

    return model.get_output_embeddings(), transform


@torch.no_grad()
def check_output_layer(model, autocast, name: str) -> None:
    """The log-probs are made from the output layer's inputs (output_layer_inputs, output_layer): one line before any
    training if `model` returns logits that its output layer and output_layer's transform do not give."""
    device = next(model.parameters()).device
    ids = (torch.arange(1, 9, device=device) % transformers_model(model).config.get_text_config().vocab_size)[None]
    was_training = model.training
    model.eval()
    try:
        with autocast():
            whole = model(input_ids=ids, use_cache=False).logits[0].float()  # (8, V)
            with output_layer_inputs(model, torch.arange(8, device=device)) as hidden:
                model(input_ids=ids, use_cache=False)
            layer, transform = output_layer(model)
            ours = transform(layer(hidden[0])).float() if hidden else None
    finally:
        model.train(was_training)
    model_name = type(transformers_model(model)).__name__.removeprefix("FSDP")
    if ours is None:
        raise UsageError(
            f"{name}: {model_name} makes its logits without calling its output layer "
            "(get_output_embeddings()), from whose inputs the log-probs here are made"
        )
    if ours.shape != whole.shape or not torch.allclose(ours, whole, rtol=1e-2, atol=1e-2 * float(whole.abs().max())):
        raise UsageError(
            f"{name}: {model_name} changes its logits after its output layer in a way the log-probs here "
            "do not reproduce (known: a soft cap, logit_scale, logits_scaling): add it to "
            "rloo_utils.output_layer"
        )


def last_true_index(mask: torch.Tensor) -> torch.Tensor:
    """(B,) column of the last 1 in each row of a (B, T) 0/1 mask: the last real token."""
    return mask.shape[1] - 1 - mask.flip(1).argmax(1)


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, so a left-padded prompt sees the same positions as an unpadded one."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


# Positions whose logits are made at a time: a chunk's fp32 logits stay at 64 MB whatever the vocabulary
LOGIT_CHUNK_ELEMENTS = 2**24


def logprobs_through_output_layer(
    output_layer,
    transform,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    support: Optional[Callable] = None,
):
    """(K,) fp32 log softmax(transform(output_layer(hidden)) / temperature)[ids], from the (K, H) hidden states that
    predict the (K,) ids, without the (K, V) logits: a chunk of positions at a time, and with gradients each chunk's
    logits are made again in the backward pass (activation checkpointing) rather than kept, so the step's peak memory
    stops growing with K x V (TRL 1.16 does the same). Detached, after it: with_entropy, the (K,) entropies
    H = -sum_v p_v log p_v; with a sampler's `support` (sampler_support), the (K,) log-probs renormalised over the
    tokens the sampler could draw (the sampled token among them), the distribution vLLM's log-probs are on."""

    def chunk_logprobs(chunk, chunk_ids):  # (k, H), (k,) -> tuple of (k,)
        logits = transform(output_layer(chunk)).float() / temperature  # (k, V)
        logprobs = logits.log_softmax(-1)
        out = [logprobs.gather(-1, chunk_ids[:, None]).squeeze(-1)]
        with torch.no_grad():
            if with_entropy:
                out.append(-(logprobs.exp() * logprobs).sum(-1))
            if support is not None:
                kept = support(logits).scatter(-1, chunk_ids[:, None], True)
                renormalised = logits.masked_fill(~kept, -math.inf).log_softmax(-1)
                out.append(renormalised.gather(-1, chunk_ids[:, None]).squeeze(-1))
        return tuple(out)

    trained = hidden.requires_grad or any(p.requires_grad for p in output_layer.parameters())
    keep_graph = torch.is_grad_enabled() and trained
    step = max(1, LOGIT_CHUNK_ELEMENTS // output_layer.weight.shape[0])
    chunks = [
        torch.utils.checkpoint.checkpoint(chunk_logprobs, chunk, chunk_ids, use_reentrant=False)
        if keep_graph
        else chunk_logprobs(chunk, chunk_ids)
        for chunk, chunk_ids in zip(hidden.split(step), ids.split(step))
    ]
    outputs = [torch.cat(values) for values in zip(*chunks)]  # K = 0: one empty chunk
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def chunked_completion_logprobs(
    model,
    prompt_ids,
    prompt_mask,
    completion_ids,
    completion_mask,
    temperature: float,
    with_entropy: bool = False,
    images: Optional[dict] = None,
    packing: Optional[str] = None,
    support: Optional[Callable] = None,
):
    """Per-token log-probs (B, C) of the completion under `model`, on logits / temperature; with_entropy, also the
    entropies, and with a sampler's `support`, the log-probs on its distribution (logprobs_through_output_layer).
    The forward stops at the output layer's inputs where a real completion token is predicted, (K, H). images: the
    rows' image tensors (images_batch), for a VLM. packing: pack_sequences' layout (padding-free), or None: padded
    rows, cut of the columns that are padding in every row (left of the longest prompt, right of the longest
    completion). Padding positions get 0.
    """
    real = completion_mask.bool()  # (B, C)
    if packing:  # the real tokens only
        mask = torch.cat([prompt_mask, completion_mask], 1)
        ids, positions, index = pack_sequences(torch.cat([prompt_ids, completion_ids], 1), mask, packing)
        with output_layer_inputs(model, index[:, prompt_ids.shape[1] :][real] - 1) as hidden:  # a token is predicted
            model(input_ids=ids, position_ids=positions, use_cache=False, **varlen_kwargs(mask, packing))  # before it
    else:
        first = int(prompt_mask.any(0).nonzero()[0])
        last = int(completion_mask.any(0).nonzero()[-1]) + 1 if completion_mask.any() else 1
        input_ids = torch.cat([prompt_ids[:, first:], completion_ids[:, :last]], dim=1)  # (B, L)
        attention_mask = torch.cat([prompt_mask[:, first:], completion_mask[:, :last]], dim=1)
        position_ids = None if builds_own_positions(model) else position_ids_from(attention_mask)
        flat_index = torch.arange(input_ids.numel(), device=input_ids.device).view(input_ids.shape)  # (B, L)
        index = flat_index[:, -last - 1 : -1]  # (B, last): where completion tokens 0..last-1 are predicted
        with output_layer_inputs(model, index[real[:, :last]]) as hidden:
            model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                **vision_inputs(model, input_ids, images),
            )
    layer, transform = output_layer(model)
    out = logprobs_through_output_layer(
        layer, transform, hidden[0], completion_ids[real], temperature, with_entropy, support
    )
    if isinstance(out, torch.Tensor):
        return out.new_zeros(real.shape).masked_scatter(real, out)  # (K,) -> (B, C)
    return tuple(values.new_zeros(real.shape).masked_scatter(real, values) for values in out)


def padding_free_logprobs(model, images: bool, console, autocast) -> Callable:
    """What --padding_free computes the log-probs of `model`'s completions with: chunked_completion_logprobs on the
    layout packing_layout probes (packed rows; padded ones where the model cannot be packed, or holds images), once
    check_output_layer has made sure that the output layer's inputs give the model's logits."""
    check_output_layer(model, autocast, "policy")
    return functools.partial(
        chunked_completion_logprobs, packing=packing_layout(model, True, images, console, "policy", autocast)
    )
