"""Bytes per parameter that a --bf16 run holds in weights, gradients and AdamW states, before and after frozen linear
layers are held in bf16 (frozen_linear_weights_to): a full fine-tune with a KL penalty, and LoRA; and the copy of the
policy that HF generate samples from (--sampler_weights).

    python benchmark/memory_per_parameter.py            # a Llama of 109.5M random weights (~2 min on 2 CPU cores)
    python benchmark/memory_per_parameter.py --untied   # an LM head of its own, which is cast too
    python benchmark/memory_per_parameter.py --hidden_size 256 --heads 4 --num_layers 4 --vocab_size 8000  # quick
    python benchmark/memory_per_parameter.py --sampler_weights policy  # no copy: the policy samples (a CPU's default)

The model is a Llama built from its config with random weights (by default hidden 768, 12 layers of 12 heads,
intermediate 2048, vocabulary 32000, the LM head tied to the embeddings), on the CPU, set up as rloo.py main() sets it
up: the full fine-tune's reference is copy.deepcopy(policy).eval().requires_grad_(False); LoRA's policy is
add_adapter(policy, ...) (by default adapters of rank 16 on every linear layer, as benchmark/lora.py) and
its reference is the same model with the adapters disabled, no copy; AdamW over the trainable parameters. "after"
then applies frozen_linear_weights_to(model, torch.bfloat16) to the policy and the reference, as rloo.py does under
--bf16; "before" skips it, which is what rloo.py did before. (rloo.py casts a reward model's linear layers too: no
reward model is counted here.) In both, the sampler's copy is made as rloo.py makes it (off_policy.sampling_copy: a
plain model of the policy's architecture in --sampler_weights' dtype, a LoRA adapter merged in): by default bfloat16,
what rloo.py's --sampler_weights auto makes on CUDA under --bf16 over float32 weights (2 bytes a parameter; a tied LM
head stays tied in the copy); with --sampler_weights policy none is made (the policy samples: 0), as on a CPU.

Measured by tensor accounting, not by the resident set: the bytes of the unique storages (shared tensors, e.g. the tied
LM head, counted once: by storage data_ptr) of the parameters of the policy and the reference, of the gradients after
one backward (of -mean completion log-prob by chunked_completion_logprobs, under torch.autocast("cpu", bfloat16), on a
micro-batch of --batch random prompts and completions: 2 x (16 + 16) tokens by default, as their number changes no
byte counted here), of AdamW's state after optimizer.step(), and of the sampler's copy; each divided by the model's
parameter count (without the adapters). Each measurement runs in a fresh process. Before the update, each also checks
that the reference's log-probs under bf16 autocast are those of the policy to the last bit (KL 0). The activations of
the backward are not counted there (benchmark/logprob_memory.py measures those of the log-probs).
"peak of an update" is the resident set's high-water mark (VmHWM, reset after the set-up) over the rollout's forwards,
the update's forward and backward and the optimizer step, less the resident set before the model was built, with
glibc told to map every block of 64 KiB or more on its own (MALLOC_MMAP_THRESHOLD_) so that freed tensors leave it:
held bytes, the activations and the allocator's slack.
"""

import argparse
import copy
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rloo_utils.models import disable_dropout, frozen_linear_weights_to  # noqa: E402
from rloo_utils.lora import adapter_disabled, add_adapter  # noqa: E402
from rloo_utils.off_policy import sampling_copy  # noqa: E402
from rloo_utils.packing import chunked_completion_logprobs  # noqa: E402

STAGES = ["policy", "frozen", "sampler", "gradients", "adamw"]


def build_model(cli):
    """The random Llama of the command line, as rloo.py holds a policy it loaded: fp32, dropout off."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=cli.hidden_size,
        num_hidden_layers=cli.num_layers,
        num_attention_heads=cli.heads,
        num_key_value_heads=cli.heads,
        intermediate_size=cli.intermediate_size,
        vocab_size=cli.vocab_size,
        tie_word_embeddings=not cli.untied,
    )
    torch.manual_seed(cli.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    disable_dropout(model)
    return model


def composition(model) -> dict:
    """Parameter counts of `model` (a shared weight once): all, linear layers' weights, embeddings, the rest (norms)."""
    unique = {id(p): p for p in model.parameters()}
    linear = {id(m.weight) for m in model.modules() if type(m) is torch.nn.Linear}
    embedding = {id(m.weight) for m in model.modules() if type(m) is torch.nn.Embedding}
    linear -= embedding  # a tied LM head is the embeddings' weight
    count = lambda ids: sum(unique[i].numel() for i in ids)  # noqa: E731
    return {
        "params": count(unique),
        "linear": count(linear),
        "embedding": count(embedding),
        "other": count(set(unique) - linear - embedding),
    }


def cpu_memory(field: str) -> int:
    """VmRSS or VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def measure(setup: str, variant: str, cli) -> dict:
    """Bytes held per stage in this process: setup "full" (with a reference) or "lora", variant "before" or "after"."""
    base = cpu_memory("VmRSS")  # the interpreter and torch, before any model
    policy = build_model(cli)
    counts = composition(policy)
    if setup == "full":
        ref = copy.deepcopy(policy).eval().requires_grad_(False)  # rloo.py's reference: a frozen copy
    else:
        policy = add_adapter(
            policy,
            lora_r=cli.lora_r,
            lora_alpha=2 * cli.lora_r,
            lora_dropout=0.0,
            lora_target_modules=cli.lora_target_modules,
            lora_modules_to_save=None,
            use_dora=False,
            seed=cli.seed,
            model_path="a random Llama",
        )
        ref = policy
    if variant == "after":
        for model in (policy, ref):
            frozen_linear_weights_to(model, torch.bfloat16)
    # The copy HF generate samples from, made at the start as rloo.py makes it (None: the policy samples)
    sampler = None if cli.sampler_weights == "policy" else sampling_copy(policy, getattr(torch, cli.sampler_weights))

    generator = torch.Generator().manual_seed(cli.seed)
    prompt_ids = torch.randint(cli.vocab_size, (cli.batch, cli.prompt_length), generator=generator)
    completion_ids = torch.randint(cli.vocab_size, (cli.batch, cli.completion_length), generator=generator)
    batch = (prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids), 1.0)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak from here: the rollout's forwards, the update's forward and backward, the step

    # Before any update: the reference's log-probs are the policy's (rloo.py's rollout forwards: eval, no grad)
    policy.eval()
    with torch.no_grad(), autocast():
        policy_logprobs = chunked_completion_logprobs(policy, *batch)
        with adapter_disabled(ref):  # LoRA: the base; a full fine-tune's copy: as it is
            ref_logprobs = chunked_completion_logprobs(ref.eval(), *batch)
    kl = {
        "equal": torch.equal(policy_logprobs, ref_logprobs),
        "max_abs_diff": float((policy_logprobs - ref_logprobs).abs().max()),
        "kl": float((policy_logprobs - ref_logprobs).mean()),
    }

    held, seen = {stage: 0 for stage in STAGES}, set()

    def add(stage, tensors):
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                held[stage] += storage.nbytes()

    trainable = [p for p in policy.parameters() if p.requires_grad]
    add("policy", trainable)
    add("frozen", [p for model in (policy, ref) for p in model.parameters() if not p.requires_grad])
    add("sampler", [] if sampler is None else sampler.parameters())
    dtypes = sorted(
        {
            str(p.dtype).removeprefix("torch.")
            for model in (policy, ref)
            for p in model.parameters()
            if not p.requires_grad
        }
    )

    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    policy.train()
    start = time.perf_counter()
    with autocast():
        loss = -chunked_completion_logprobs(policy, *batch).mean()
    loss.backward()
    backward_s = time.perf_counter() - start
    add("gradients", [p.grad for model in (policy, ref) for p in model.parameters() if p.grad is not None])
    optimizer.step()
    add("adamw", [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)])
    return {
        "held": held,
        "peak": cpu_memory("VmHWM") - base,
        "counts": counts,
        "trainable": sum(p.numel() for p in trainable),
        "kl": kl,
        "frozen_dtypes": dtypes,
        "backward_s": backward_s,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"memory_per_parameter.py: error: {message}")  # one line, no usage block
    parser.add_argument("--hidden_size", type=int, default=768)
    parser.add_argument("--num_layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate_size", type=int, default=2048)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--untied", action="store_true", help="an LM head of its own (tie_word_embeddings False)")
    parser.add_argument("--lora_r", type=int, default=16, help="LoRA rank (alpha: 2r, as rloo.py's defaults)")
    parser.add_argument("--lora_target_modules", nargs="+", default=["all-linear"])
    parser.add_argument("--batch", type=int, default=2, help="rows of the micro-batch of the backward")
    parser.add_argument("--prompt_length", type=int, default=16)
    parser.add_argument(
        "--completion_length",
        type=int,
        default=16,
        help="(a bf16 backward on a CPU without bf16 matrix units is slow: 2 x 64 tokens take ~1 min)",
    )
    parser.add_argument(
        "--sampler_weights",
        choices=["bfloat16", "float16", "policy"],
        default="bfloat16",
        help="the copy HF generate samples from (rloo.py's auto on CUDA under --bf16: bfloat16); policy: none",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # setup, variant
    cli = parser.parse_args()
    if cli.worker:
        print(json.dumps(measure(*cli.worker, cli)))
        return

    results = {}
    for setup in ["full", "lora"]:
        for variant in ["before", "after"]:
            out = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--worker", setup, variant],
                capture_output=True,
                text=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "65536"},
            )
            if out.returncode:
                last = (out.stderr.strip().splitlines() or [""])[-1]
                sys.exit(f"memory_per_parameter.py: error: the {setup} {variant} measurement failed: {last}")
            results[setup, variant] = json.loads(out.stdout.strip().splitlines()[-1])

    counts = results["full", "before"]["counts"]
    n = counts["params"]
    share = {k: counts[k] / n for k in ("linear", "embedding", "other")}
    adapters = results["lora", "before"]["trainable"]
    print(
        f"Llama, hidden {cli.hidden_size}, {cli.num_layers} layers of {cli.heads} heads, intermediate "
        f"{cli.intermediate_size}, vocabulary {cli.vocab_size}, LM head {'untied' if cli.untied else 'tied'}: "
        f"{n:,} parameters: linear layers' weights {counts['linear']:,} ({share['linear']:.1%}), embeddings "
        f"{counts['embedding']:,} ({share['embedding']:.1%}), norms {counts['other']:,} ({share['other']:.2%})"
    )
    print(
        f"LoRA: rank {cli.lora_r} on {' '.join(cli.lora_target_modules)}: {adapters:,} adapter parameters "
        f"({adapters / n:.2%}); backward of {cli.batch} x ({cli.prompt_length} + {cli.completion_length}) tokens "
        f"under bf16 autocast on CPU; bytes / {n:,}"
    )
    print()
    names = {
        "full": {
            "policy": "policy weights (fp32, trained)",
            "frozen": "reference (frozen copy)",
            "sampler": f"sampler's copy (--sampler_weights {cli.sampler_weights})",
            "gradients": "gradients (fp32)",
            "adamw": "AdamW states (2 x fp32)",
        },
        "lora": {
            "policy": "adapters (fp32, trained)",
            "frozen": "frozen base (= the reference)",
            "sampler": f"sampler's copy (--sampler_weights {cli.sampler_weights}, adapters merged)",
            "gradients": "gradients (adapters)",
            "adamw": "AdamW states (adapters)",
        },
    }
    label = {"full": "full + KL", "lora": "LoRA"}
    print("| setup | before B/param | after B/param |")
    print("|---|---|---|")
    for setup in ["full", "lora"]:
        before, after = results[setup, "before"]["held"], results[setup, "after"]["held"]
        for stage in STAGES:
            print(f"| {label[setup]}: {names[setup][stage]} | {before[stage] / n:.3f} | {after[stage] / n:.3f} |")
        total_before, total_after = sum(before.values()) / n, sum(after.values()) / n
        print(
            f"| **{label[setup]}: total** | **{total_before:.3f}** | **{total_after:.3f}** "
            f"({1 - total_after / total_before:.1%} less) |"
        )
        peak_before, peak_after = (results[setup, v]["peak"] / n for v in ("before", "after"))
        print(
            f"| {label[setup]}: peak of an update (resident set) | {peak_before:.3f} | {peak_after:.3f} "
            f"({1 - peak_after / peak_before:.1%} less) |"
        )
    print()
    ref = {v: results["full", v]["held"]["frozen"] / n for v in ("before", "after")}
    print(
        f"The reference's share: {ref['before']:.3f} -> {ref['after']:.3f} B/param: its linear layers' weights "
        f"({share['linear']:.1%} of the parameters) 4 -> 2 B, the embeddings"
        f"{'' if cli.untied else ' (with the tied LM head)'} and norms ({share['embedding'] + share['other']:.1%}) "
        f"stay fp32 (expected 4 x {share['embedding'] + share['other']:.3f} + 2 x {share['linear']:.3f} = "
        f"{4 * (share['embedding'] + share['other']) + 2 * share['linear']:.3f})."
    )
    copy = {s: results[s, "after"]["held"]["sampler"] / n for s in ("full", "lora")}
    untied = 2 * (1 + (0 if cli.untied else share["embedding"]))  # a tied LM head held twice in the copy
    print(
        f"The sampler's copy (--sampler_weights {cli.sampler_weights}): full + KL {copy['full']:.3f}, LoRA "
        f"{copy['lora']:.3f} B/param"
        + (
            ": none is made, the policy samples (expected 0)"
            if cli.sampler_weights == "policy"
            else f": every weight in {cli.sampler_weights}, the LoRA adapters merged in (expected 2 x 1 = 2.000 with "
            f"the LM head tied to the embeddings as in the policy; {untied:.3f} where the copy holds it apart)"
        )
    )
    print(
        "Frozen weights' dtypes: "
        + "; ".join(
            f"{label[s]} {v}: {', '.join(results[s, v]['frozen_dtypes'])}"
            for s in ("full", "lora")
            for v in ("before", "after")
        )
    )
    said = lambda kl: (
        "equal, KL 0"
        if kl["equal"]  # noqa: E731
        else f"max |diff| {kl['max_abs_diff']:.3g}, KL {kl['kl']:.3g}"
    )
    print(
        "Reference's log-probs = the policy's before any update (bf16 autocast): "
        + "; ".join(f"{label[s]} {v}: {said(r['kl'])}" for (s, v), r in results.items())
    )
    if not all(r["kl"]["equal"] for r in results.values()):
        sys.exit("memory_per_parameter.py: error: the reference's log-probs differ from the policy's before any update")


if __name__ == "__main__":
    main()
