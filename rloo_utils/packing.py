"""Padding-free forwards: the real tokens of a micro-batch packed into rows, positions restarting per sequence; where an
attention kernel cannot keep packed sequences apart, padded forwards (probed once at start). The output layer's inputs,
from which the log-probs are made a chunk at a time, their gradient by checkpointed chunks or by our fused output layer
(--fused_output_layer); the training forward's decoder layers compiled one by one (--compile_decoder_layers)."""

import contextlib
import functools
import itertools
import math
import sys
from typing import Callable, Optional

import torch
import torch.utils.checkpoint

from rloo_utils.errors import UsageError, describe
from rloo_utils.lora import transformers_model
from rloo_utils.vision import builds_own_positions, images_batch, vision_inputs

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

    def catch(module, inputs: tuple):
        """A forward pre-hook: `inputs`, the output layer's positional inputs, the hidden states first."""
        hidden = inputs[0].flatten(0, 1)[index]  # (K, H)
        caught.append(hidden)
        return (hidden[None, :0], *inputs[1:])  # (1, 0, H): logits of no position

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
# On a GPU a chunk is sized by its free memory instead (logit_chunk_positions): an eighth of it at BYTES_PER_LOGIT a
# logit (a chunk's logits in the compute dtype and in fp32, their log-softmax, and in the backward their gradient),
# between LOGIT_CHUNK_ELEMENTS and MAX_GPU_LOGIT_CHUNK_ELEMENTS (2 GiB of such work): 8k tokens of a 151,936-word
# vocabulary are then 10 products of 883 positions rather than 75 of 110, each large enough to keep a GPU busy.
MAX_GPU_LOGIT_CHUNK_ELEMENTS = 2**27
BYTES_PER_LOGIT = 16


def logit_chunk_positions(vocab_size: int, device: torch.device) -> int:
    """How many positions' logits logprobs_through_output_layer makes at a time: LOGIT_CHUNK_ELEMENTS logits on a CPU;
    on a GPU as many as an eighth of its free memory holds (the driver's free memory and what the caching allocator
    holds unused), bounded by MAX_GPU_LOGIT_CHUNK_ELEMENTS."""
    elements = LOGIT_CHUNK_ELEMENTS
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        elements = min(max(elements, free // (8 * BYTES_PER_LOGIT)), MAX_GPU_LOGIT_CHUNK_ELEMENTS)
    return max(1, elements // vocab_size)


def chunk_logprobs(
    layer, transform, temperature: float, with_entropy: bool, entropy_grad: bool, support, chunk, chunk_ids
) -> tuple:
    """One chunk of logprobs_through_output_layer: the (k,) fp32 log softmax(transform(layer(chunk)) / T)[chunk_ids]
    of the (k, H) hidden states, then the entropies if with_entropy (with their gradient if entropy_grad), and, without
    gradients, the log-probs on a sampler's support if given."""
    logits = transform(layer(chunk)).float() / temperature  # (k, V)
    logprobs = logits.log_softmax(-1)
    out = [logprobs.gather(-1, chunk_ids[:, None]).squeeze(-1)]
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            out.append(-(logprobs.exp() * logprobs).sum(-1))
    with torch.no_grad():
        if support is not None:
            kept = support(logits).scatter(-1, chunk_ids[:, None], True)
            renormalised = logits.masked_fill(~kept, -math.inf).log_softmax(-1)
            out.append(renormalised.gather(-1, chunk_ids[:, None]).squeeze(-1))
    return tuple(out)


def add_product_in_float32(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b into the float32 `total`, each product and its sum in float32 whatever a's and b's dtype
    (bfloat16 under autocast): on a GPU cuBLAS's float32 output of bfloat16 inputs (mm's out_dtype), elsewhere float32
    copies of them (a product of two bfloat16 numbers is exact in float32, so the two agree)."""
    if a.dtype == torch.float32:
        total.addmm_(a, b)
        return
    if total.is_cuda:
        try:
            total.add_(torch.mm(a, b, out_dtype=torch.float32))
            return
        except (NotImplementedError, RuntimeError, TypeError):  # a GPU or build without it: the copies below
            pass
    total.addmm_(a.float(), b.float())


class FusedOutputLayerLogprobs(torch.autograd.Function):
    """logprobs_through_output_layer with gradients, for a linear output layer without bias (--fused_output_layer).
    Checkpointed chunks (torch.utils.checkpoint) make each chunk's logits again in the backward pass and give autograd
    a whole (V, H) gradient of the weight per chunk, which it adds up, in bfloat16 under autocast (75 of them for 8k
    tokens of a 151,936-word vocabulary). Here the forward makes each chunk's log-probs as that path does (the same
    function, the same chunks: the same numbers) and keeps only the hidden states and the ids (and the weight, a
    parameter held anyway), never logits; the backward makes each chunk's logits again, takes their gradient
    d log p_y / d logits = g (onehot(y) - softmax) as log_softmax's backward does (and, for the entropy bonus, the
    entropy's d H / d logits = -p (log p + H) times its gradient), chains it through the transform and
    the temperature by autograd on that chunk alone, and from it the chunk's hidden-state gradient and its share of
    the weight's, summed over every chunk in one float32 buffer and returned once in the weight's dtype. A weight tied
    to the input embeddings gets it added to the embeddings' own by autograd, as any gradient of a shared tensor.
    Inputs: hidden (K, H), weight (V, H), ids (K,), then layer (the module whose weight it is), transform,
    temperature, the chunk's positions, with_entropy, entropy_grad, support (logprobs_through_output_layer). Outputs:
    the (K,) log-probs, then the entropies (with a gradient if entropy_grad) and the log-probs on the support if asked,
    those without gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, layer, transform, temperature, step, with_entropy, entropy_grad, support):
        device_type = hidden.device.type
        # The backward's product must be the forward's: under autocast, in its dtype (autocast's state is not the
        # backward's, which may run on another thread)
        ctx.autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        ctx.transform, ctx.temperature, ctx.step = transform, temperature, step
        ctx.save_for_backward(hidden, weight, ids)
        ctx.set_materialize_grads(False)  # an output the loss does not use has no gradient to make
        chunks = [  # (autograd.Function's forward runs without gradients: its backward makes them)
            chunk_logprobs(layer, transform, temperature, with_entropy, False, support, chunk, chunk_ids)
            for chunk, chunk_ids in zip(hidden.split(step), ids.split(step))
        ]
        outputs = tuple(torch.cat(values) for values in zip(*chunks))  # K = 0: one empty chunk
        ctx.mark_non_differentiable(*outputs[1 + (with_entropy and entropy_grad) :])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, logprobs_grad, entropy_grad=None, *no_grad):
        hidden, weight, ids = ctx.saved_tensors
        wants_hidden, wants_weight = ctx.needs_input_grad[:2]
        dtype = ctx.autocast or weight.dtype
        device_type = hidden.device.type
        matrix = weight.to(dtype)  # autocast's cast of the weight, once for every chunk
        weight_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_weight else None
        hidden_grads = []
        zeros = hidden.new_zeros(len(ids), dtype=torch.float32)  # an output's gradient that autograd left out
        logprobs_grad = zeros if logprobs_grad is None else logprobs_grad
        entropy_grad = None if entropy_grad is None else entropy_grad.split(ctx.step)
        for i, (chunk, chunk_ids, g) in enumerate(
            zip(hidden.split(ctx.step), ids.split(ctx.step), logprobs_grad.split(ctx.step))
        ):
            chunk = chunk.to(dtype)
            with torch.autocast(device_type, dtype=ctx.autocast, enabled=ctx.autocast is not None):
                raw = torch.nn.functional.linear(chunk, matrix).requires_grad_()  # (k, V): the forward's product
                with torch.enable_grad():
                    logits = ctx.transform(raw).float() / ctx.temperature
            # log_softmax's backward of a one-hot gradient g at y: g onehot(y) - exp(log p) g
            logprobs = logits.detach().log_softmax(-1)  # (k, V)
            logits_grad = logprobs.exp().mul_(-g[:, None])
            logits_grad.scatter_add_(-1, chunk_ids[:, None], g[:, None])
            if entropy_grad is not None:  # H = -sum_v p_v log p_v: d H / d logits = -p (log p + H)
                entropy = -(logprobs.exp() * logprobs).sum(-1, keepdim=True)  # (k, 1)
                logits_grad -= entropy_grad[i][:, None] * logprobs.exp() * (logprobs + entropy)
            del logprobs
            (raw_grad,) = torch.autograd.grad(logits, raw, logits_grad)  # through the transform and temperature
            del logits, logits_grad
            if wants_hidden:
                hidden_grads.append((raw_grad @ matrix).to(hidden.dtype))
            if wants_weight:
                add_product_in_float32(weight_grad, raw_grad.T, chunk)
        hidden_grad = torch.cat(hidden_grads) if wants_hidden else None
        weight_grad = weight_grad.to(weight.dtype) if wants_weight else None
        return hidden_grad, weight_grad, None, None, None, None, None, None, None, None


def fused_output_layer_refusal(layer) -> Optional[str]:
    """Why FusedOutputLayerLogprobs cannot take `layer`'s gradient, or None: it takes a torch.nn.Linear without bias.
    A LoRA adapter on the output layer (peft's layer) or a bias keep checkpointed chunks."""
    if type(layer) is not torch.nn.Linear:
        return f"its output layer is a {type(layer).__module__}.{type(layer).__name__}, not a torch.nn.Linear"
    if layer.bias is not None:
        return "its output layer has a bias"
    return None


def is_sharded(layer) -> bool:
    """Whether `layer`'s weight is at this moment an FSDP2 shard (a DTensor), whose product only the layer's own
    forward can take (rloo_multigpu.py gathers its LM head for the root's forward, before the log-probs are made).
    Without torch.distributed.tensor imported there is no DTensor, and rloo.py never imports it."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(layer.weight, dtensor.DTensor)


def logprobs_through_output_layer(
    output_layer,
    transform,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    support: Optional[Callable] = None,
    fused: bool = False,
    entropy_grad: bool = False,
):
    """(K,) fp32 log softmax(transform(output_layer(hidden)) / temperature)[ids], from the (K, H) hidden states that
    predict the (K,) ids, without the (K, V) logits: a chunk of positions at a time (logit_chunk_positions), and with
    gradients each chunk's logits are made again in the backward pass rather than kept, so the step's peak memory
    stops growing with K x V (TRL 1.16 does the same): by activation checkpointing of each chunk, or with `fused`
    (--fused_output_layer) and a linear output layer without bias by FusedOutputLayerLogprobs, which sums the weight's
    gradient over the chunks once, in float32. After it: with_entropy, the (K,) entropies H = -sum_v p_v log p_v,
    with their gradient if entropy_grad (the entropy bonus), else detached; detached, with a sampler's `support`
    (sampler_support), the (K,) log-probs renormalised over the tokens the sampler could draw (the sampled token among
    them), the distribution vLLM's log-probs are on."""
    trained = hidden.requires_grad or any(p.requires_grad for p in output_layer.parameters())
    keep_graph = torch.is_grad_enabled() and trained
    step = logit_chunk_positions(output_layer.weight.shape[0], hidden.device)
    chunk = functools.partial(chunk_logprobs, output_layer, transform, temperature, with_entropy, entropy_grad, support)
    if keep_graph and fused and fused_output_layer_refusal(output_layer) is None and not is_sharded(output_layer):
        outputs = FusedOutputLayerLogprobs.apply(
            hidden,
            output_layer.weight,
            ids,
            output_layer,
            transform,
            temperature,
            step,
            with_entropy,
            entropy_grad,
            support,
        )
        return outputs[0] if len(outputs) == 1 else outputs
    chunks = [
        torch.utils.checkpoint.checkpoint(chunk, hidden_chunk, chunk_ids, use_reentrant=False)
        if keep_graph
        else chunk(hidden_chunk, chunk_ids)
        for hidden_chunk, chunk_ids in zip(hidden.split(step), ids.split(step))
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
    entropy_grad: bool = False,
    images: Optional[dict] = None,
    packing: Optional[str] = None,
    support: Optional[Callable] = None,
    fused: bool = False,
):
    """Per-token log-probs (B, C) of the completion under `model`, on logits / temperature; with_entropy, also the
    entropies (with their gradient if entropy_grad), and with a sampler's `support`, the log-probs on its distribution
    (logprobs_through_output_layer, whose gradient through the output layer is FusedOutputLayerLogprobs' with `fused`).
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
        layer, transform, hidden[0], completion_ids[real], temperature, with_entropy, support, fused, entropy_grad
    )
    if isinstance(out, torch.Tensor):
        return out.new_zeros(real.shape).masked_scatter(real, out)  # (K,) -> (B, C)
    return tuple(values.new_zeros(real.shape).masked_scatter(real, values) for values in out)


def rollout_logprobs(model, rollout, logprobs_of, autocast, chunk: int, temperature: float, support=None):
    """(B, C) log-probs of a rollout's completions under `model`, without gradients, in chunks of `chunk` rows
    (--local_rollout_forward_batch_size); with a sampler's support (the vLLM scripts' sampler_support) also (B, C)
    log-probs on its distribution. logprobs_of: the script's completion_logprobs, or its padding-free form."""
    model.eval()  # no adapter dropout: the sampling policy's log-probs
    device, on_support = rollout.prompt_ids.device, {} if support is None else {"support": support}
    with torch.no_grad(), autocast():
        chunks = [
            logprobs_of(
                model,
                rollout.prompt_ids[i : i + chunk],
                rollout.prompt_mask[i : i + chunk],
                rollout.completion_ids[i : i + chunk],
                rollout.completion_mask[i : i + chunk],
                temperature,
                images=images_batch(rollout.images, slice(i, i + chunk), device, model.dtype),
                **on_support,
            )
            for i in range(0, len(rollout.prompt_ids), chunk)
        ]
    return torch.cat(chunks).float() if support is None else tuple(torch.cat(c).float() for c in zip(*chunks))


def padding_free_logprobs(model, image_column, console, autocast, fused_output_layer: str = "auto") -> Callable:
    """What --padding_free computes the log-probs of `model`'s completions with: chunked_completion_logprobs on the
    layout packing_layout probes (packed rows; padded ones where the model cannot be packed, or holds images), once
    check_output_layer has made sure that the output layer's inputs give the model's logits. fused_output_layer
    (--fused_output_layer): the gradient through the output layer by FusedOutputLayerLogprobs ("on"; "auto": on a
    GPU), or by checkpointed chunks ("off"; "auto" on a CPU, so that its numbers stay those of before; and an output
    layer that is not a linear one without bias, said in one line)."""
    check_output_layer(model, autocast, "policy")
    assert fused_output_layer in ("auto", "on", "off"), fused_output_layer
    on_gpu = next(model.parameters()).device.type == "cuda"
    fused = fused_output_layer == "on" or (fused_output_layer == "auto" and on_gpu)
    if fused and (refusal := fused_output_layer_refusal(model.get_output_embeddings())):
        console.print(f"policy: the output layer's gradient by checkpointed chunks, not fused: {refusal}")
        fused = False
    return functools.partial(
        chunked_completion_logprobs,
        packing=packing_layout(model, True, bool(image_column), console, "policy", autocast),
        fused=fused,
    )


class CompiledWhereTrained:
    """A decoder layer's forward, compiled (torch.compile) where autograd records it, the training forward and its
    recomputation under gradient checkpointing, and run as it is under no_grad: HF generate's forwards, whose KV cache
    grows a position a step (a graph for each length, and its own compiled step with a static cache), and the rollout's
    log-prob forwards."""

    def __init__(self, forward, backend: str):
        self.eager, self.compiled = forward, torch.compile(forward, backend=backend)

    def __call__(self, *args, **kwargs):
        return (self.compiled if torch.is_grad_enabled() else self.eager)(*args, **kwargs)


def compile_decoder_layers(model, wanted: bool, backend: str = "inductor") -> int:
    """--compile_decoder_layers: each decoder layer of `model` (a causal LM, peft-wrapped or not) compiled on its own
    where it is trained (CompiledWhereTrained), so that its small operations (norms, rotary embeddings, activations)
    become fewer kernels; a layer, not the whole model, so that the traced graph is one layer's whatever the depth, and
    the output layer's hook (output_layer_inputs), the chunked log-probs and FSDP's hooks around each layer stay as they
    are. The layers: the modules of the model's decoder (get_decoder) of the classes transformers lists in
    _no_split_modules, each layer's own class (FSDP2 prefixes it with FSDP). Returns how many were compiled; none
    found is an error in one line. Nothing without `wanted`."""
    if not wanted:
        return 0
    inner = transformers_model(model)
    layer_classes = set(getattr(inner, "_no_split_modules", None) or [])
    layers = [m for m in inner.get_decoder().modules() if type(m).__name__.removeprefix("FSDP") in layer_classes]
    if not layers:
        raise UsageError(
            f"--compile_decoder_layers: {type(inner).__name__} names no decoder layer class (_no_split_modules)"
        )
    for layer in layers:
        if not isinstance(layer.forward, CompiledWhereTrained):  # called twice: compiled once
            layer.forward = CompiledWhereTrained(layer.forward, backend)
    return len(layers)
