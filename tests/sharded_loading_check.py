"""Run by torchrun from test_sharded_loading.py: on each process, a model loaded as rloo_multigpu.py loaded it before
issue 26 (from_pretrained whole, then sharded) beside the same model built empty, sharded and filled by load_shards;
then both saved. Writes, per case, what the test compares: rank -> {streamed, differences, ...} in OUT/<case>.json.

usage: torchrun --nproc_per_node 2 sharded_loading_check.py OUT CASES_JSON
CASES_JSON: [{"name", "auto_class" (a transformers Auto class), "path", "kwargs", "cpu_offload", "tokenizer"}]
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rloo_utils.models import from_pretrained  # noqa: E402
from rloo_utils.processes import end_processes  # noqa: E402
from rloo_utils.sharded import empty_model, save_sharded_model, shard  # noqa: E402


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def main(out: str, cases: list[dict]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for case in cases:
        auto_class = getattr(transformers, case["auto_class"])
        kwargs = case.get("kwargs", {})
        old = from_pretrained(auto_class, case["path"], dtype=torch.float32, **kwargs)
        old = shard(old, mesh, False, case.get("cpu_offload", False))
        new = empty_model(auto_class, case["path"], torch.float32, **kwargs)
        streamed = new.pretrained_weights[0] is not None
        shard(new, mesh, False, case.get("cpu_offload", False))  # (load_shards inside)
        old_state, new_state = old.state_dict(), new.state_dict()
        old_buffers, new_buffers = dict(old.named_buffers()), dict(new.named_buffers())
        report = {
            "streamed": streamed,
            "keys_equal": list(old_state) == list(new_state),
            "different_weights": [
                k
                for k in old_state
                if k in new_state
                and not (
                    local(old_state[k]).dtype == local(new_state[k]).dtype
                    and torch.equal(local(old_state[k]), local(new_state[k]))
                )
            ],
            "different_buffers": [
                k for k in old_buffers if not torch.equal(old_buffers[k], new_buffers.get(k, torch.empty(0)))
            ],
            "local_numel": sum(local(t).numel() for t in new_state.values()),
            "numel": sum(t.numel() for t in new_state.values()),
            "generation_config_equal": (not old.can_generate())
            or old.generation_config.to_dict() == new.generation_config.to_dict(),
            "training": [old.training, new.training],
            "tied": [
                getattr(m.config.get_text_config(), "tie_word_embeddings", False)
                and m.get_output_embeddings().weight is m.get_input_embeddings().weight
                for m in (old, new)
            ]
            if old.get_output_embeddings() is not None
            else None,
            "missing_weights": new.missing_weights,
        }
        # Saved: today's way (the whole model gathered on rank 0, save_pretrained) and shard by shard
        full = get_model_state_dict(old, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            old.save_pretrained(os.path.join(out, case["name"], "old"), state_dict=full)
        tokenizer = transformers.AutoTokenizer.from_pretrained(case.get("tokenizer", case["path"]))
        save_sharded_model(os.path.join(out, case["name"], "new"), new, tokenizer)
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        if rank == 0:
            with open(os.path.join(out, f"{case['name']}.json"), "w") as f:
                json.dump(reports, f)
    end_processes(0)  # (as the scripts end: gloo's teardown at exit may abort a process)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
