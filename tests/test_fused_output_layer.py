"""The fused output layer (--fused_output_layer, FusedOutputLayerLogprobs in rloo_utils/packing.py): its log-probs,
entropies and gradients are those of autograd through plain operations in float64, of the checkpointed chunks and of
the scripts' completion_logprobs (the definition), a tied embedding's gradient included; under bf16 autocast it sums
the weight's gradient more exactly than checkpointed chunks do; an output layer with a bias or an adapter keeps the
checkpointed chunks; the option is off on a CPU unless asked. Also the GPU's chunk size and --compile_decoder_layers."""

import contextlib
import functools
import io
import math
import os
import sys
import types
import typing

import pytest
import torch
from rich.console import Console

import rloo_vllm
import rloo_utils.packing as packing_module
from rloo_utils.errors import UsageError
from rloo_utils.models import SpeedOptions
from rloo_utils.packing import (
    chunked_completion_logprobs,
    compile_decoder_layers,
    logit_chunk_positions,
    logprobs_through_output_layer,
    padding_free_logprobs,
)
from test_padding_free import ragged_batch, tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmark"))

V, H, K = 50, 16, 24
TRANSFORMS = {
    "none": None,
    "soft cap": (1.0, 2.0),  # Gemma's final_logit_softcapping
    "scale and cap": (0.25, 3.0),  # Cohere's logit_scale, then a cap
}


def logit_transform(name: str):
    """The transform output_layer() makes for a model: logits x scale, then a soft cap; None: the identity."""
    if TRANSFORMS[name] is None:
        return identity
    return functools.partial(scale_and_cap, *TRANSFORMS[name])


def identity(logits):
    return logits


def scale_and_cap(scale, cap, logits):
    return cap * torch.tanh(logits * scale / cap)


def grad_fn_names(tensor: torch.Tensor) -> set:
    """The class names of every node of the autograd graph that made `tensor`."""
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def float64_reference(weight, transform, hidden, ids, temperature, loss_weights):
    """Log-probs, entropies and the gradients (hidden, weight) of sum(w * log-probs), by autograd through plain float64
    operations on the whole (K, V) logits: what the fused function must give, computed without any of its code."""
    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    logprobs = torch.log_softmax(transform(hidden64 @ weight64.T) / temperature, -1)
    picked = logprobs.gather(-1, ids[:, None]).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    grads = torch.autograd.grad((picked * loss_weights.double()).sum(), [hidden64, weight64])
    return picked.detach(), entropy.detach(), *grads


def forward_backward(layer, transform, hidden, ids, temperature, loss_weights, fused, **options):
    """The log-probs (and what else is asked) of logprobs_through_output_layer and the gradients of sum(w * log-probs)
    with respect to the hidden states and the layer's parameters."""
    out = logprobs_through_output_layer(layer, transform, hidden, ids, temperature, fused=fused, **options)
    logprobs = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad((logprobs * loss_weights).sum(), [hidden, *layer.parameters()])
    return out, grads, grad_fn_names(logprobs)


# ----------------------------------------------------------------------------------------------------------------
# The fused function against plain autograd, in float32
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_elements", [2**24, 1, 3 * V])  # one chunk; a chunk per position; 3 positions a chunk
@pytest.mark.parametrize("transform_name", sorted(TRANSFORMS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logprobs_entropies_and_gradients_are_plain_autograds(
    monkeypatch, chunk_elements, transform_name, temperature
):
    """Log-probs, entropies and both gradients (hidden states, weight) equal float64 autograd through plain operations
    to float32 rounding, and the checkpointed chunks' (the forward is theirs to the last digit); the fused function
    made them (its node is in the graph)."""
    monkeypatch.setattr(packing_module, "LOGIT_CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(0)
    layer = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(K, H, requires_grad=True)
    ids, loss_weights = torch.randint(V, (K,)), torch.randn(K)
    transform = logit_transform(transform_name)
    top_5 = lambda logits: logits >= logits.topk(5).values[..., -1:]  # noqa: E731  (a sampler's support, as top-k)
    options = dict(with_entropy=True, support=top_5)
    (logprobs, entropy, on_support), grads, nodes = forward_backward(
        layer, transform, hidden, ids, temperature, loss_weights, True, **options
    )
    assert "FusedOutputLayerLogprobsBackward" in nodes and "LogSoftmaxBackward0" not in nodes
    assert not entropy.requires_grad and not on_support.requires_grad
    expected_logprobs, expected_entropy, hidden_grad, weight_grad = float64_reference(
        layer.weight, transform, hidden, ids, temperature, loss_weights
    )
    torch.testing.assert_close(logprobs.double(), expected_logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), expected_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0].double(), hidden_grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1].double(), weight_grad, rtol=1e-5, atol=1e-6)
    assert grads[0].dtype == grads[1].dtype == torch.float32
    checkpointed, checkpointed_grads, nodes = forward_backward(
        layer, transform, hidden, ids, temperature, loss_weights, False, **options
    )
    assert "FusedOutputLayerLogprobsBackward" not in nodes and "LogSoftmaxBackward0" in nodes
    for value, expected in zip((logprobs, entropy, on_support), checkpointed):
        assert torch.equal(value, expected)  # the same function on the same chunks
    for grad, expected in zip(grads, checkpointed_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_elements", [2**24, 1, 3 * V])
@pytest.mark.parametrize("transform_name", sorted(TRANSFORMS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_with_the_entropy_bonus_the_fused_gradients_are_plain_autograds(
    monkeypatch, chunk_elements, transform_name, temperature
):
    """With entropy_grad (--entropy_coef) the entropies carry a gradient: that of sum(w log p + u H) by the fused
    backward equals float64 autograd through plain operations, and the checkpointed chunks'."""
    monkeypatch.setattr(packing_module, "LOGIT_CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(1)
    layer = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(K, H, requires_grad=True)
    ids, loss_weights, entropy_weights = torch.randint(V, (K,)), torch.randn(K), torch.randn(K)
    transform = logit_transform(transform_name)
    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = layer.weight.detach().double().requires_grad_()
    logprobs64 = torch.log_softmax(transform(hidden64 @ weight64.T) / temperature, -1)
    entropy64 = -(logprobs64.exp() * logprobs64).sum(-1)
    objective = (logprobs64.gather(-1, ids[:, None]).squeeze(-1) * loss_weights.double()).sum()
    expected = torch.autograd.grad(objective + (entropy64 * entropy_weights.double()).sum(), [hidden64, weight64])
    for fused in (True, False):
        logprobs, entropy = logprobs_through_output_layer(
            layer, transform, hidden, ids, temperature, with_entropy=True, fused=fused, entropy_grad=True
        )
        assert entropy.requires_grad
        grads = torch.autograd.grad(
            (logprobs * loss_weights).sum() + (entropy * entropy_weights).sum(), [hidden, layer.weight]
        )
        for grad, want in zip(grads, expected):
            torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{fused}: {m}")


def test_fused_gradients_flow_to_whichever_input_needs_one():
    """A frozen output layer (a LoRA policy's) gets no gradient and the hidden states theirs; a trained layer under
    frozen hidden states its own; no position: empty log-probs and zero gradients."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(H, V, bias=False)
    hidden, ids, loss_weights = torch.randn(K, H), torch.randint(V, (K,)), torch.randn(K)
    _, _, hidden_grad, weight_grad = float64_reference(layer.weight, identity, hidden, ids, 0.9, loss_weights)
    layer.requires_grad_(False)
    out = logprobs_through_output_layer(layer, identity, hidden.requires_grad_(), ids, 0.9, fused=True)
    (grad,) = torch.autograd.grad((out * loss_weights).sum(), [hidden])
    torch.testing.assert_close(grad.double(), hidden_grad, rtol=1e-5, atol=1e-6)
    layer.requires_grad_(True)
    out = logprobs_through_output_layer(layer, identity, hidden.detach(), ids, 0.9, fused=True)
    (grad,) = torch.autograd.grad((out * loss_weights).sum(), [layer.weight])
    torch.testing.assert_close(grad.double(), weight_grad, rtol=1e-5, atol=1e-6)
    empty = logprobs_through_output_layer(layer, identity, hidden.detach()[:0], ids[:0], 1.0, fused=True)
    assert empty.shape == (0,) and empty.dtype == torch.float32
    (grad,) = torch.autograd.grad(empty.sum(), [layer.weight])
    assert torch.equal(grad, torch.zeros_like(layer.weight))


def test_fused_backward_keeps_no_vocabulary_sized_tensor(monkeypatch):
    """What the fused function saves for its backward: the hidden states, the weight and the ids, no (k, V) chunk of
    logits (the checkpointed path's test is in tests/test_formulas.py)."""
    monkeypatch.setattr(packing_module, "LOGIT_CHUNK_ELEMENTS", 2 * V)  # two positions a chunk
    torch.manual_seed(0)
    layer = torch.nn.Linear(H, V, bias=False)
    hidden, ids = torch.randn(K, H, requires_grad=True), torch.randint(V, (K,))
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        out = logprobs_through_output_layer(layer, identity, hidden, ids, 0.9, with_entropy=True, fused=True)
    assert sorted(saved) == sorted([(K, H), (V, H), (K,)]), saved
    out[0].sum().backward()
    assert hidden.grad.shape == (K, H) and layer.weight.grad.shape == (V, H)


# ----------------------------------------------------------------------------------------------------------------
# In a model: the definition's numbers, a tied embedding's gradient
# ----------------------------------------------------------------------------------------------------------------
def tied_llama():
    """A 2-layer Llama whose output layer's weight is its input embeddings' (tie_word_embeddings), eval mode."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model.eval()


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("family", ["tied llama", "llama", "gemma2"])
def test_fused_in_a_model_gives_the_definitions_numbers_and_a_tied_embeddings_gradient(
    monkeypatch, family, entropy_grad
):
    """chunked_completion_logprobs with the fused output layer, packed and padded, gives the definition's
    (rloo_vllm.completion_logprobs, whose support is vLLM's) log-probs, entropies, log-probs on a support and gradient
    of every parameter, the tied embeddings' (the sum of its use as input embeddings and as output layer) among them,
    with the entropy bonus's share where the entropies carry a gradient; Gemma 2's soft cap is applied."""
    monkeypatch.setattr(packing_module, "LOGIT_CHUNK_ELEMENTS", 3 * 300)  # 3 positions a chunk: many chunks
    model = tied_llama() if family == "tied llama" else tiny_model(family, "sdpa")
    batch = ragged_batch()
    real = batch[3].bool()
    top_5 = lambda logits: logits >= logits.topk(5).values[..., -1:]  # noqa: E731
    loss_weights = torch.randn(real.shape, generator=torch.Generator().manual_seed(2))
    entropy_weights = 0.5 * torch.randn(real.shape, generator=torch.Generator().manual_seed(3))

    def forward(logprobs_of):
        model.zero_grad()
        logprobs, entropy, on_support = logprobs_of(
            model, *batch, 0.7, with_entropy=True, entropy_grad=entropy_grad, support=top_5
        )
        assert entropy.requires_grad == entropy_grad
        bonus = (entropy * entropy_weights * real).sum() if entropy_grad else 0.0
        ((logprobs * loss_weights * real).sum() + bonus).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return (logprobs, entropy, on_support), grads, grad_fn_names(logprobs)

    definition, definition_grads, _ = forward(rloo_vllm.completion_logprobs)
    for packing in [None, "rows"]:
        values, grads, nodes = forward(functools.partial(chunked_completion_logprobs, packing=packing, fused=True))
        assert "FusedOutputLayerLogprobsBackward" in nodes
        for value, expected in zip(values, definition):
            torch.testing.assert_close(value[real], expected[real], rtol=1e-5, atol=1e-5)
        assert grads.keys() == definition_grads.keys()
        for name, expected in definition_grads.items():
            torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-5, msg=name)
    if family == "tied llama":  # one parameter, both uses: without the output layer's share the test above would fail
        assert "lm_head.weight" not in definition_grads
        monkeypatch.setattr(packing_module, "add_product_in_float32", lambda total, a, b: None)
        _, grads, _ = forward(functools.partial(chunked_completion_logprobs, packing="rows", fused=True))
        embeddings = "model.embed_tokens.weight"
        assert not torch.allclose(grads[embeddings], definition_grads[embeddings], rtol=1e-2, atol=1e-3)


# ----------------------------------------------------------------------------------------------------------------
# Under bf16 autocast: the same forward, a weight gradient summed in float32
# ----------------------------------------------------------------------------------------------------------------
def test_under_bf16_autocast_fused_is_the_checkpointed_forward_and_sums_the_weight_gradient_more_exactly(monkeypatch):
    """Under bf16 autocast (--bf16) the fused function's log-probs, entropies and hidden-state gradient are those of
    the checkpointed chunks to the last digit (the same bf16 products), and both are close to float64 autograd on the
    bf16-rounded inputs; the weight's gradient, which checkpointed chunks add up in bf16 chunk after chunk, the fused
    function sums in float32: nearer the float64 one."""
    monkeypatch.setattr(packing_module, "LOGIT_CHUNK_ELEMENTS", 2 * 512)  # 2 positions a chunk: 128 chunks
    torch.manual_seed(0)
    vocab, width, tokens = 512, 64, 256
    layer = torch.nn.Linear(width, vocab, bias=False)
    hidden = torch.randn(tokens, width, requires_grad=True)
    ids, loss_weights = torch.randint(vocab, (tokens,)), torch.randn(tokens)
    results = {}
    for fused in [False, True]:
        with torch.autocast("cpu", torch.bfloat16):
            out, grads, nodes = forward_backward(
                layer, identity, hidden, ids, 0.7, loss_weights, fused, with_entropy=True
            )
        assert ("FusedOutputLayerLogprobsBackward" in nodes) == fused
        assert all(value.dtype == torch.float32 for value in (*out, *grads))
        results[fused] = out, grads
    (checkpointed, checkpointed_grads), (values, grads) = results[False], results[True]
    for value, expected in zip(values, checkpointed):
        assert torch.equal(value, expected)
    assert torch.equal(grads[0], checkpointed_grads[0])
    as_bf16 = lambda x: x.detach().to(torch.bfloat16).float()  # noqa: E731  (what autocast hands the product)
    logprobs64, entropy64, hidden_grad64, weight_grad64 = float64_reference(
        as_bf16(layer.weight), identity, as_bf16(hidden), ids, 0.7, loss_weights
    )
    torch.testing.assert_close(values[0].double(), logprobs64, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(values[1].double(), entropy64, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grads[0].double(), hidden_grad64, rtol=2e-2, atol=2e-2)

    def error(grad):
        return float((grad.double() - weight_grad64).norm() / weight_grad64.norm())

    fused_error, checkpointed_error = error(grads[1]), error(checkpointed_grads[1])
    assert fused_error < 1e-2 and checkpointed_error < 5e-2, (fused_error, checkpointed_error)
    assert fused_error <= checkpointed_error / 2, (fused_error, checkpointed_error)  # measured: 0.0019 vs 0.0086
    assert (checkpointed_grads[1].to(torch.bfloat16).float() == checkpointed_grads[1]).all()  # bf16 sums
    assert not (grads[1].to(torch.bfloat16).float() == grads[1]).all()  # float32 sums


def test_bf16_weights_get_their_gradient_in_bf16_summed_in_float32():
    """An output layer held in bf16 (FSDP2's mixed precision gathers it so; bf16 weights): the gradient comes back
    in its dtype, rounded once from the float32 sum, as near the float64 one as one rounding allows."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(H, V, bias=False).to(torch.bfloat16)
    hidden = torch.randn(K, H).to(torch.bfloat16).requires_grad_()
    ids, loss_weights = torch.randint(V, (K,)), torch.randn(K)
    _, (hidden_grad, weight_grad), _ = forward_backward(layer, identity, hidden, ids, 1.0, loss_weights, True)
    assert hidden_grad.dtype == weight_grad.dtype == torch.bfloat16
    _, _, hidden_grad64, weight_grad64 = float64_reference(layer.weight, identity, hidden, ids, 1.0, loss_weights)
    torch.testing.assert_close(weight_grad.double(), weight_grad64, rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(hidden_grad.double(), hidden_grad64, rtol=2e-2, atol=1e-2)


# ----------------------------------------------------------------------------------------------------------------
# Where it falls back, and the option
# ----------------------------------------------------------------------------------------------------------------
def test_a_biased_output_layer_keeps_the_checkpointed_chunks():
    """A bias: the checkpointed chunks' graph (autograd's log-softmax, no fused node), and the gradients of plain
    autograd, the bias's included."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(H, V, bias=True)
    torch.nn.init.normal_(layer.bias)
    hidden, ids, loss_weights = torch.randn(K, H, requires_grad=True), torch.randint(V, (K,)), torch.randn(K)
    out, grads, nodes = forward_backward(layer, identity, hidden, ids, 0.8, loss_weights, True)
    assert "FusedOutputLayerLogprobsBackward" not in nodes and "LogSoftmaxBackward0" in nodes  # autograd's chunks
    assert len(grads) == 3  # hidden, weight, bias
    logits = torch.nn.functional.linear(hidden.double(), layer.weight.double(), layer.bias.double()) / 0.8
    expected = logits.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    expected_grads = torch.autograd.grad((expected * loss_weights.double()).sum(), [hidden, *layer.parameters()])
    torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    for grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), want.double(), rtol=1e-5, atol=1e-6)


def padding_free_line(model, option: str):
    """padding_free_logprobs' function for `model` with --fused_output_layer `option`, and what it printed."""
    out = io.StringIO()
    logprobs_of = padding_free_logprobs(model, False, Console(file=out, width=300), contextlib.nullcontext, option)
    return logprobs_of, out.getvalue()


def test_the_option_is_off_on_a_cpu_unless_asked_and_refused_for_an_adapted_or_biased_head():
    """--fused_output_layer: SpeedOptions declares auto, on, off (auto by default); auto is off on a CPU (every CPU
    number as before), on is on; an LM head with a LoRA adapter or a bias is said in one line and keeps the
    checkpointed chunks. No-grad forwards never take the fused path."""
    from peft import LoraConfig, get_peft_model

    assert typing.get_args(typing.get_type_hints(SpeedOptions)["fused_output_layer"]) == ("auto", "on", "off")
    assert SpeedOptions.fused_output_layer == "auto"
    model = tiny_model("llama", "sdpa")
    for option, fused in [("auto", False), ("off", False), ("on", True)]:
        logprobs_of, printed = padding_free_line(model, option)
        assert logprobs_of.keywords["fused"] is fused and printed == ""
    default = padding_free_logprobs(model, False, Console(quiet=True), contextlib.nullcontext)  # the scripts' call
    assert default.keywords["fused"] is False
    logprobs_of, _ = padding_free_line(model, "on")
    with torch.no_grad():
        assert logprobs_of(model, *ragged_batch(), 1.0).grad_fn is None
    adapted = get_peft_model(
        tiny_model("llama", "sdpa"), LoraConfig(r=4, target_modules=["lm_head", "q_proj"], lora_dropout=0.0)
    )
    logprobs_of, printed = padding_free_line(adapted, "on")
    assert logprobs_of.keywords["fused"] is False
    assert "policy: the output layer's gradient by checkpointed chunks, not fused: its output layer is a " in printed
    assert "peft.tuners.lora" in printed and len(printed.strip().splitlines()) == 1
    biased = tiny_model("llama", "sdpa")
    biased.lm_head.bias = torch.nn.Parameter(torch.zeros(300))  # the model's logits are still its output layer's
    logprobs_of, printed = padding_free_line(biased, "on")
    assert logprobs_of.keywords["fused"] is False and "its output layer has a bias" in printed
    logprobs_of, printed = padding_free_line(biased, "auto")  # off on a CPU: nothing to say
    assert logprobs_of.keywords["fused"] is False and printed == ""


def test_gpu_chunks_are_sized_by_free_memory_within_bounds_and_the_cpu_chunk_is_unchanged(monkeypatch):
    """On a CPU a chunk is LOGIT_CHUNK_ELEMENTS logits, as before; on a GPU an eighth of the free memory (the driver's
    and the caching allocator's unused) at BYTES_PER_LOGIT a logit, never below the CPU's chunk nor above
    MAX_GPU_LOGIT_CHUNK_ELEMENTS."""
    vocab = 151936
    assert logit_chunk_positions(vocab, torch.device("cpu")) == 2**24 // vocab == 110
    gib = 2**30
    for free, unused, expected in [
        (0, 0, 110),  # nothing free: the CPU's chunk
        (8 * gib, 0, 8 * gib // (8 * 16) // vocab),  # 8 GiB free: 2**26 logits, 441 positions
        (8 * gib, 8 * gib, 16 * gib // (8 * 16) // vocab),  # as much again held unused by the allocator
        (100 * gib, 0, 2**27 // vocab),  # bounded: 883 positions
    ]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 141 * gib))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device, unused=unused: unused + 5 * gib)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 5 * gib)
        assert logit_chunk_positions(vocab, torch.device("cuda")) == expected
    assert logit_chunk_positions(10, torch.device("cuda")) == 2**27 // 10
    assert logit_chunk_positions(2**28, torch.device("cpu")) == 1  # at least one position


# ----------------------------------------------------------------------------------------------------------------
# --compile_decoder_layers
# ----------------------------------------------------------------------------------------------------------------
class CountingBackend:
    """A torch.compile backend that runs the traced graph as it is, counting the graphs it is given and their calls."""

    def __init__(self):
        self.graphs = self.calls = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return functools.partial(self.run, graph_module)

    def run(self, graph_module, *args):
        self.calls += 1
        return graph_module(*args)


def logprobs_and_grads(model, batch):
    """The padding-free log-probs of `batch`, their entropies, and each trained parameter's gradient of their sum."""
    model.zero_grad()
    logprobs, entropy = chunked_completion_logprobs(model, *batch, 0.7, with_entropy=True, packing="rows")
    logprobs.sum().backward()
    return logprobs.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "gpt2", "lora llama", "checkpointed llama"])
def test_compile_decoder_layers_compiles_each_layer_where_it_is_trained(family):
    """Each decoder layer (two here; of a peft-wrapped model too) compiled on its own: the training forward goes
    through the compiled layers (with gradient checkpointing its recomputation too) and gives the same log-probs,
    entropies and gradients; a no-grad forward (generation, the rollout's log-probs) does not; a second call compiles
    nothing more; off, nothing."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model(family.split()[-1], "sdpa")
    if family.startswith("lora"):
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    runs_a_step = 2  # compiled layer calls of one training forward and backward
    if family.startswith("checkpointed"):
        model.gradient_checkpointing_enable()  # transformers' default: non-reentrant
        model.train()  # (it recomputes in training mode only; the tiny Llama has no dropout)
        runs_a_step = 4
    batch = ragged_batch()
    expected = logprobs_and_grads(model, batch)
    assert compile_decoder_layers(model, False) == 0
    backend = CountingBackend()
    assert compile_decoder_layers(model, True, backend=backend) == 2
    got = logprobs_and_grads(model, batch)
    assert backend.graphs >= 1 and backend.calls == runs_a_step  # one graph may serve both layers
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)
    assert got[2].keys() == expected[2].keys()
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    graphs = backend.graphs
    with torch.no_grad():
        chunked_completion_logprobs(model, *batch, 0.7, packing="rows")
        model.generate(input_ids=batch[0][:1], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert (backend.graphs, backend.calls) == (graphs, runs_a_step)
    assert compile_decoder_layers(model, True, backend=backend) == 2
    logprobs_and_grads(model, batch)
    assert (backend.graphs, backend.calls) == (graphs, 2 * runs_a_step)  # not wrapped twice


def test_compile_decoder_layers_refuses_a_model_without_decoder_layer_classes_in_one_line():
    model = tiny_model("llama", "sdpa")
    model._no_split_modules = None
    with pytest.raises(UsageError, match=r"--compile_decoder_layers: LlamaForCausalLM names no decoder layer class"):
        compile_decoder_layers(model, True)


@pytest.mark.slow
def test_inductor_compiled_decoder_layers_give_the_same_logprobs_and_gradients():
    """With torch.compile's own backend (inductor: C++ kernels on a CPU), the log-probs, entropies and gradients of the
    training forward are the eager ones to float32 rounding."""
    model = tiny_model("llama", "sdpa")
    batch = ragged_batch()
    expected = logprobs_and_grads(model, batch)
    assert compile_decoder_layers(model, True) == 2
    for _ in range(2):  # the second call runs the compiled code again
        got = logprobs_and_grads(model, batch)
        torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1], expected[1], rtol=1e-4, atol=1e-4)
        for name, grad in expected[2].items():
            torch.testing.assert_close(got[2][name], grad, rtol=1e-3, atol=1e-4, msg=name)


# ----------------------------------------------------------------------------------------------------------------
# benchmark/output_layer_grad.py
# ----------------------------------------------------------------------------------------------------------------
def test_the_benchmark_times_both_paths_and_measures_their_errors_against_float64(monkeypatch):
    """Both paths, their seconds and gradient errors; in fp32 both errors are float32 rounding, under bf16 the fused
    weight gradient's is the smaller. A path's seconds are the median of its own timed steps (the warm-up untimed,
    the repeats of the two paths taken in turn), read here on a clock the test sets; no peak on a CPU."""
    import output_layer_grad

    # Each step start and end, in turn: the checkpointed steps take 1, 10 and 2 s, the fused ones 3, 0.5 and 30
    # (medians 2 and 3; means 4.33 and 11.17)
    readings = iter([0.0, 1.0, 1.0, 4.0, 4.0, 14.0, 14.0, 14.5, 14.5, 16.5, 16.5, 46.5])
    monkeypatch.setattr(output_layer_grad, "time", types.SimpleNamespace(perf_counter=lambda: next(readings)))
    device = torch.device("cpu")
    results = output_layer_grad.compare(64, 16, 40, False, 3, device)
    assert results.keys() == {"checkpointed", "fused"}
    assert (results["checkpointed"]["seconds"], results["fused"]["seconds"]) == (2.0, 3.0)
    assert next(readings, None) is None  # each timed step read the clock twice, nothing else did
    for result in results.values():
        assert result["peak_mib"] is None
        assert result["weight_error"] < 1e-5 and result["hidden_error"] < 1e-5
    assert math.isfinite(results["fused"]["weight_error"])
