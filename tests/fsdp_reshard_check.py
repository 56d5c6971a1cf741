"""Run by torchrun from test_fsdp_reshard.py: a frozen model sharded by rloo_utils.sharded.shard that only runs no_grad
forwards (the reference policy; the reward model, whose backbone and score head reward_model_scores calls one by one)
keeps its root units' weights gathered after the forward (plain tensors, not DTensor shards) until
rloo_multigpu.reshard puts them back in shards; the next forward gathers them again and gives the same outputs.
Writes [report of rank 0, of rank 1] to OUT (a JSON file), each report {case: {...}}.

usage: torchrun --standalone --nproc_per_node 2 fsdp_reshard_check.py OUT POLICY_PATH REWARD_PATH
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rloo_multigpu  # noqa: E402
from rloo_utils.models import from_pretrained, policy_class  # noqa: E402
from rloo_utils.processes import end_processes  # noqa: E402
from rloo_utils.sharded import empty_model, load_sharded_reward_model, shard  # noqa: E402
from rloo_utils.scoring import reward_model_scores


def gathered_names(model: torch.nn.Module) -> list[str]:
    """The parameters that are not DTensor shards: those a unit holds gathered."""
    return [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]


def inputs(vocab_size: int, pad_token_id: int, rank: int):
    """4 left-padded rows of 12 tokens, different on each process."""
    generator = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, vocab_size, (4, 12), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 3, 5, 1]):
        mask[row, :pad] = 0
        ids[row, :pad] = pad_token_id
    return ids, mask


def run_case(model: torch.nn.Module, forward, whole_forward) -> dict:
    """forward() twice under no_grad, each followed by rloo_multigpu.reshard (the second by FSDP2's reshard() of the
    outermost unit first), with what is gathered at each point."""
    report = {
        "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "parameters": len(list(model.named_parameters())),
        "before_forward": gathered_names(model),
    }
    with torch.no_grad():
        first = forward()
    report["after_forward"] = gathered_names(model)
    rloo_multigpu.reshard(model)
    report["after_reshard"] = gathered_names(model)
    with torch.no_grad():
        second = forward()
    report["after_second_forward"] = gathered_names(model)
    model.reshard()  # FSDP2's own, on the outermost unit only (not recursive)
    report["after_outer_reshard_only"] = gathered_names(model)
    rloo_multigpu.reshard(model)
    report["after_second_reshard"] = gathered_names(model)
    report["outputs_equal"] = torch.equal(first, second)
    report["outputs_finite"] = bool(first.isfinite().all())
    # the same forward on the model loaded whole, unsharded: the sharded model computes what it computes
    report["max_difference_from_unsharded"] = float((first - whole_forward()).abs().max())
    return report


def main(out: str, policy_path: str, reward_path: str) -> None:
    from transformers import AutoModelForSequenceClassification

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reports = {}

    # The reference policy: one root (embeddings, norm, tied LM head) over the decoder layers' units
    auto_class = policy_class(policy_path)
    reference = empty_model(auto_class, policy_path, torch.float32).requires_grad_(False)
    reference = shard(reference, mesh, False, False)
    ids, mask = inputs(reference.config.vocab_size, reference.config.pad_token_id, rank)
    whole = from_pretrained(auto_class, policy_path, dtype=torch.float32).eval()
    logits = lambda m: m(input_ids=ids, attention_mask=mask, use_cache=False).logits  # noqa: E731
    with torch.no_grad():
        expected = logits(whole)
    reports["reference"] = run_case(reference, lambda: logits(reference), lambda: expected)

    # The reward model: its backbone and score head, units of their own, called one by one (each becomes a root)
    reward_model = load_sharded_reward_model(reward_path)
    reward_model = shard(reward_model, mesh, False, False)
    whole = from_pretrained(AutoModelForSequenceClassification, reward_path, num_labels=1, dtype=torch.float32).eval()
    expected = reward_model_scores(whole, ids, mask)
    reports["reward_model"] = run_case(
        reward_model, lambda: reward_model_scores(reward_model, ids, mask), lambda: expected
    )
    reports["reward_model"]["scores"] = expected.tolist()

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, reports)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f, indent=1)
    end_processes(0)  # (as the scripts end: gloo's teardown at exit may abort a process)


if __name__ == "__main__":
    main(*sys.argv[1:4])
