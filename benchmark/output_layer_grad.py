"""One forward and backward of the log-probs of N tokens through a linear output layer: by checkpointed chunks and by
the fused output layer (--fused_output_layer, rloo_utils/packing.py's FusedOutputLayerLogprobs), side by side in one
run.

    python benchmark/output_layer_grad.py                                           # Qwen2.5-0.5B's, 32 x 256 tokens
    python benchmark/output_layer_grad.py --vocab 32000 --hidden 256 --tokens 2048  # small enough for a CPU

The workload is what the training forward hands logprobs_through_output_layer: the (N, H) hidden states that predict N
completion tokens (random, needing a gradient), a (V, H) output layer without bias holding float32 weights (the
policy's, also under --bf16), random ids, temperature 0.7, the entropies asked for as the update asks; the loss is
the sum of the log-probs times random weights (advantages). --precision bf16 (the default on a GPU) runs it under
torch.autocast in bfloat16, as --bf16 does. Each path runs once to warm up, then --repeats times, taken in turn with
the other, the gradients set to None before each as an optimizer step leaves them; the table gives the median
seconds, and on a GPU the peak of allocated memory above what was held before the step.

How far each gradient is from the exact one: the relative error (norm of the difference over the norm) against a
float64 computation through plain operations (autograd, no chunking of the sum) on the same inputs as rounded for the
product (bfloat16 under --precision bf16). Under bfloat16 checkpointed chunks add the weight's gradient up in
bfloat16, chunk by chunk; the fused layer sums it in float32.
"""

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rloo_utils.packing import logit_chunk_positions, logprobs_through_output_layer  # noqa: E402

PATHS = {"checkpointed": False, "fused": True}
TEMPERATURE = 0.7


def workload(vocab: int, hidden: int, tokens: int, device: torch.device, seed: int = 0):
    """The output layer (V, H) in float32, hidden states (N, H) that need a gradient, ids (N,), loss weights (N,)."""
    generator = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(vocab, hidden, generator=generator) / hidden**0.5)
    states = torch.randn(tokens, hidden, generator=generator)
    ids = torch.randint(vocab, (tokens,), generator=generator)
    weights = torch.randn(tokens, generator=generator)
    return layer.to(device), states.to(device).requires_grad_(), ids.to(device), weights.to(device)


def identity(logits: torch.Tensor) -> torch.Tensor:
    """The transform after the output layer: none (a Llama's, Qwen's)."""
    return logits


def step(layer, states, ids, weights, fused: bool, bf16: bool) -> None:
    """One forward (log-probs and entropies) and backward of the log-probs, as a training micro-batch makes them."""
    layer.weight.grad = states.grad = None
    with torch.autocast(states.device.type, dtype=torch.bfloat16, enabled=bf16):
        logprobs, _ = logprobs_through_output_layer(
            layer, identity, states, ids, TEMPERATURE, with_entropy=True, fused=fused
        )
    (logprobs * weights).sum().backward()


def exact_gradients(layer, states, ids, weights, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the loss with respect to the hidden states and the weight in float64 through plain operations
    (autograd), of the inputs as the product sees them (rounded to bfloat16 under bf16, outside what is
    differentiated); a slice of 2**24 logits at a time, the weight's gradient summed in float64."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    weight64 = layer.weight.detach().to(dtype).double().requires_grad_()
    hidden_grads, weight_grad = [], torch.zeros_like(weight64)
    step = max(1, 2**24 // layer.weight.shape[0])
    for start in range(0, len(ids), step):
        states64 = states.detach()[start : start + step].to(dtype).double().requires_grad_()
        logits = states64 @ weight64.T / TEMPERATURE
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[start : start + step, None]).squeeze(-1)
        loss = (logprobs * weights[start : start + step].double()).sum()
        hidden_grad, weight_grad_part = torch.autograd.grad(loss, [states64, weight64])
        hidden_grads.append(hidden_grad)
        weight_grad += weight_grad_part
    return torch.cat(hidden_grads), weight_grad


def relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return float((value.double() - exact).norm() / exact.norm())


def compare(vocab: int, hidden: int, tokens: int, bf16: bool, repeats: int, device: torch.device) -> dict:
    """{path: {"seconds": median, "peak_mib": on a GPU, else None, "weight_error", "hidden_error"}} of both paths on
    one workload, the repeats of the two taken in turn."""
    layer, states, ids, weights = workload(vocab, hidden, tokens, device)
    exact_hidden, exact_weight = exact_gradients(layer, states, ids, weights, bf16)
    results = {path: {"seconds": []} for path in PATHS}
    for path, fused in PATHS.items():  # warm-up, and the gradients whose error is reported
        step(layer, states, ids, weights, fused, bf16)
        results[path]["weight_error"] = relative_error(layer.weight.grad, exact_weight)
        results[path]["hidden_error"] = relative_error(states.grad, exact_hidden)
        results[path]["peak_mib"] = None
    del exact_hidden, exact_weight
    for _ in range(repeats):
        for path, fused in PATHS.items():
            layer.weight.grad = states.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            step(layer, states, ids, weights, fused, bf16)
            if device.type == "cuda":
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - held) / 2**20
                results[path]["peak_mib"] = max(results[path]["peak_mib"] or 0.0, peak)
            results[path]["seconds"].append(time.perf_counter() - start)
    for result in results.values():
        result["seconds"] = statistics.median(result["seconds"])
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"output_layer_grad.py: error: {message}")  # one line, no usage block
    parser.add_argument("--vocab", type=int, default=151936, help="output layer's rows (default: Qwen2.5-0.5B's)")
    parser.add_argument("--hidden", type=int, default=896, help="output layer's columns (default: Qwen2.5-0.5B's)")
    parser.add_argument("--tokens", type=int, default=32 * 256, help="completion tokens (default: 32 x 256)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each path, after one of warm-up")
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="bf16" if torch.cuda.is_available() else "fp32",
        help="bf16: under torch.autocast in bfloat16 (default on a GPU), as --bf16",
    )
    cli = parser.parse_args()
    if min(cli.vocab, cli.hidden, cli.tokens, cli.repeats) < 1:
        parser.error("--vocab, --hidden, --tokens and --repeats must be >= 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = (
        f"GPU {torch.cuda.get_device_name()}" if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    )
    chunk = logit_chunk_positions(cli.vocab, device)
    results = compare(cli.vocab, cli.hidden, cli.tokens, cli.precision == "bf16", cli.repeats, device)
    print(
        f"output layer V={cli.vocab} H={cli.hidden}, {cli.tokens} tokens, {cli.precision} on {where}; chunks of "
        f"{chunk} positions ({-(-cli.tokens // chunk)}); one forward + backward, median of {cli.repeats}"
    )
    print(f"{'path':<14}{'seconds':>10}{'peak MiB':>11}{'weight grad error':>19}{'hidden grad error':>19}")
    for path, result in results.items():
        peak = f"{result['peak_mib']:.0f}" if result["peak_mib"] is not None else "-"
        print(
            f"{path:<14}{result['seconds']:>10.4f}{peak:>11}{result['weight_error']:>19.2e}{result['hidden_error']:>19.2e}"
        )
    print(f"fused speed-up: {results['checkpointed']['seconds'] / results['fused']['seconds']:.2f}x")


if __name__ == "__main__":
    main()
