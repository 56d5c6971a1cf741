"""Peak memory of one training micro-batch's log-probs and entropies: rloo.py's computation against the ones it
replaced.

    python benchmark/logprob_memory.py                          # SmolLM2-135M-Instruct (vocabulary 49152)
    python benchmark/logprob_memory.py --model qwen2.5-0.5b-shape --batch 8 --prompt_length 32 \
        --completion_lengths 1024                                # V = 151,936, 8k completion tokens

Each measurement runs in a fresh process: load the policy, run one micro-batch (forward with log-probs of the
completion and entropies, then backward of -mean log-prob) to warm up, reset the peak, run a second one and report
how far the peak rose above the memory held before it. On CPU that is the resident set (VmHWM, reset by writing 5
to /proc/self/clear_refs), with glibc told to map every block of 64 KiB or more on its own
(MALLOC_MMAP_THRESHOLD_), so that a freed tensor leaves the resident set at once; on GPU it is
torch.cuda.max_memory_allocated. In fp32, and on a GPU also under bf16 autocast
(on a CPU without bf16 matrix units one such step takes minutes: `--precisions fp32 bf16` asks for it).

"--model qwen2.5-0.5b-shape" is a model built from a config with Qwen2.5-0.5B's output layer and embeddings (hidden
896, vocabulary 151,936, tied) and one decoder layer of its shape, random weights: the output layer is what is measured.

--before picks the code compared with the scripts' chunked_completion_logprobs ("after"), each kept here verbatim:
  49250cc  the (K, V) logits made whole by the model, log-softmax a chunk of positions at a time (recomputed in the
           backward pass); replaced by the log-probs made from the output layer's inputs a chunk at a time (issue 37)
  9152136  fp32 copies of the whole logits (replaced by 49250cc's chunking)
"""

import argparse
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import rloo  # noqa: E402
from rloo_utils.models import disable_dropout, from_pretrained  # noqa: E402
from rloo_utils.packing import chunked_completion_logprobs, position_ids_from  # noqa: E402

QWEN_SHAPE = "qwen2.5-0.5b-shape"


# ---- rloo.py as of commit 9152136 --------------------------------------------------------------------------------
def old_selective_log_softmax(logits, ids):
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1).float()
    return picked - torch.logsumexp(logits.float(), dim=-1)


def old_entropy_from_logits(logits):
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def old_completion_logprobs(
    model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, with_entropy=False
):
    C = completion_ids.shape[1]
    first = int(prompt_mask.any(0).nonzero()[0])
    last = int(completion_mask.any(0).nonzero()[-1]) + 1 if completion_mask.any() else 1
    input_ids = torch.cat([prompt_ids[:, first:], completion_ids[:, :last]], dim=1)
    attention_mask = torch.cat([prompt_mask[:, first:], completion_mask[:, :last]], dim=1)
    logits = (
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from(attention_mask),
            logits_to_keep=last + 1,
            use_cache=False,
        ).logits[:, :-1]
        / temperature
    )
    logprobs = F.pad(old_selective_log_softmax(logits, completion_ids[:, :last]), (0, C - last))
    if not with_entropy:
        return logprobs
    with torch.no_grad():
        entropy = F.pad(old_entropy_from_logits(logits), (0, C - last))
    return logprobs, entropy


# ---- rloo.py as of commit 49250cc (its padded path; the padding-free one made the same (1, K, V) logits) -----------
LOGIT_CHUNK_ELEMENTS = 2**24


def positions_per_chunk(logits):
    return max(1, LOGIT_CHUNK_ELEMENTS // (logits.shape[0] * logits.shape[2]))


def whole_logits_selective_log_softmax(logits, ids, temperature=1.0):
    def chunk_logprobs(chunk, chunk_ids):
        chunk = chunk.float() / temperature
        return chunk.gather(-1, chunk_ids.unsqueeze(-1)).squeeze(-1) - chunk.logsumexp(-1)

    keep_graph = torch.is_grad_enabled() and logits.requires_grad
    step = positions_per_chunk(logits)
    return torch.cat(
        [
            torch.utils.checkpoint.checkpoint(chunk_logprobs, chunk, chunk_ids, use_reentrant=False)
            if keep_graph
            else chunk_logprobs(chunk, chunk_ids)
            for chunk, chunk_ids in zip(logits.split(step, dim=1), ids.split(step, dim=1))
        ],
        dim=1,
    )


@torch.no_grad()
def whole_logits_entropy(logits, temperature=1.0):
    entropies = []
    for chunk in logits.split(positions_per_chunk(logits), dim=1):
        logp = torch.log_softmax(chunk.float() / temperature, dim=-1)
        entropies.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(entropies, dim=1)


def whole_logits_completion_logprobs(
    model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, with_entropy=False
):
    C = completion_ids.shape[1]
    first = int(prompt_mask.any(0).nonzero()[0])
    last = int(completion_mask.any(0).nonzero()[-1]) + 1 if completion_mask.any() else 1
    input_ids = torch.cat([prompt_ids[:, first:], completion_ids[:, :last]], dim=1)
    attention_mask = torch.cat([prompt_mask[:, first:], completion_mask[:, :last]], dim=1)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from(attention_mask),
        logits_to_keep=last + 1,
        use_cache=False,
    ).logits[:, :-1]
    targets, fit = completion_ids[:, :last], lambda values: F.pad(values, (0, C - last))
    logprobs = fit(whole_logits_selective_log_softmax(logits, targets, temperature))
    return (logprobs, fit(whole_logits_entropy(logits, temperature))) if with_entropy else logprobs


# ------------------------------------------------------------------------------------------------------------------

IMPLEMENTATIONS = {
    "9152136": old_completion_logprobs,
    "49250cc": whole_logits_completion_logprobs,
    "after": chunked_completion_logprobs,
}


def load_policy(model_path: str):
    """The policy measured: a checkpoint, or (QWEN_SHAPE) Qwen2.5-0.5B's output layer and one of its decoder layers."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if model_path != QWEN_SHAPE:
        return from_pretrained(AutoModelForCausalLM, model_path)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=1,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    )
    return AutoModelForCausalLM.from_config(config)


def cpu_memory(field: str) -> int:
    """VmRSS or VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def measure(
    implementation: str,
    model_path: str,
    batch: int,
    prompt_length: int,
    completion_length: int,
    bf16: bool,
    gradient_checkpointing: bool,
):
    """Peak memory (bytes) one micro-batch adds, in this process."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy = load_policy(model_path).to(device).train()
    disable_dropout(policy)
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    vocab = policy.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(vocab, (batch, prompt_length), generator=generator).to(device)
    completion_ids = torch.randint(vocab, (batch, completion_length), generator=generator).to(device)
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
    logprobs_of = IMPLEMENTATIONS[implementation]

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logprobs, entropy = logprobs_of(
                policy, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7, with_entropy=True
            )
        (-logprobs.mean()).backward()
        policy.zero_grad(set_to_none=False)  # keep the gradient buffers, as a training step does
        return float(entropy.mean())

    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - held
    held = cpu_memory("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    step()
    return cpu_memory("VmHWM") - held


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"logprob_memory.py: error: {message}")  # one line, no usage block
    parser.add_argument(
        "--model",
        default=rloo.Args.model_name_or_path,
        help=f"policy (default: rloo.py's embedded one), or {QWEN_SHAPE}",
    )
    parser.add_argument("--before", choices=["49250cc", "9152136"], default="49250cc", help="the code compared")
    parser.add_argument("--batch", type=int, default=16, help="completions in the micro-batch (rloo.py's default: 16)")
    parser.add_argument("--prompt_length", type=int, default=48)
    parser.add_argument("--completion_lengths", type=int, nargs="+", default=[32, 256])
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=["fp32", "bf16"],
        default=["fp32", "bf16"] if torch.cuda.is_available() else ["fp32"],
    )
    parser.add_argument("--gradient_checkpointing", action="store_true", help="as rloo.py --gradient_checkpointing")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)  # implementation, completion length, bf16, model
    cli = parser.parse_args()
    if cli.worker:
        implementation, completion_length, bf16, model = cli.worker
        print(
            measure(
                implementation,
                model,
                cli.batch,
                cli.prompt_length,
                int(completion_length),
                bf16 == "bf16",
                cli.gradient_checkpointing,
            )
        )
        return
    device = "GPU " + torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (resident set)"
    print(
        f"{os.path.basename(cli.model)}: peak memory of one micro-batch of {cli.batch} (prompt {cli.prompt_length} "
        f"tokens), forward + backward with entropies, on {device}"
        + (", gradient checkpointing" if cli.gradient_checkpointing else "")
    )
    print(f"before: rloo.py as of commit {cli.before}; after: rloo_utils/packing.py's chunked_completion_logprobs")
    print(f"{'completion':>10} {'precision':>9} {'before MiB':>11} {'after MiB':>10} {'saved':>7}")
    for completion_length in cli.completion_lengths:
        for precision in cli.precisions:
            peaks = {}
            for implementation in [cli.before, "after"]:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--batch",
                        str(cli.batch),
                        "--prompt_length",
                        str(cli.prompt_length),
                        "--worker",
                        implementation,
                        str(completion_length),
                        precision,
                        cli.model,
                    ]
                    + ["--gradient_checkpointing"] * cli.gradient_checkpointing,
                    check=True,
                    capture_output=True,
                    text=True,
                    env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
                )
                peaks[implementation] = int(out.stdout.split()[-1]) / 2**20
            print(
                f"{completion_length:>10} {precision:>9} {peaks[cli.before]:>11.0f} {peaks['after']:>10.0f} "
                f"{1 - peaks['after'] / peaks[cli.before]:>7.0%}"
            )


if __name__ == "__main__":
    main()
