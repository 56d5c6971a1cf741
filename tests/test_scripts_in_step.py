"""The scripts repeat the algorithm on purpose, so that each stands alone; this keeps what they share identical.

Every top-level function, class and constant defined in more than one script must have the same source in each, except
the intended differences named below, each with its reason. A fix in one script is then a fix in all of them.
"""

import ast
import os

import pytest

from conftest import ROOT, SCRIPTS

INTENDED_DIFFERENCES = {
    "Args": "rloo_vllm.py adds the --vllm_* options; rloo_multigpu.py --fsdp_cpu_offload, --ddp_timeout and the server's",
    "RESUMABLE_CHANGES": "rloo_vllm.py: the server's address and the engine's memory can change on resume; "
                         "rloo_multigpu.py: the collective timeout",
    "batch_sizes": "rloo_multigpu.py: old TRL's per-device sizes times the number of processes",
    "check_args": "rloo_multigpu.py: each process's batch holds whole groups",
    "optimizer_step": "rloo_multigpu.py: the gradient norm of the FSDP shards is a DTensor",
    "_report_one_line_error": "rloo_multigpu.py: an error every process raised is reported by rank 0 only",
    "RunGuard": "rloo_multigpu.py: the checkpoint is written by every process, and only when all of them failed together",
    "save_checkpoint": "rloo_multigpu.py: torch.distributed.checkpoint shards instead of save_pretrained",
    "load_training_state": "rloo_multigpu.py: checks the sharded checkpoint and the number of processes",
    "save_model": "rloo_multigpu.py: the shards gathered on rank 0 first",
    "resume_command": "rloo_multigpu.py: launched with torchrun",
    "check_vllm_args": "rloo_multigpu.py has only the server's options",
    "nccl_transfer": "rloo_multigpu.py: a server is asked for by its address, not by --vllm_mode",
    "weights_for_vllm": "rloo_multigpu.py: the shards gathered one tensor at a time",
}


def top_level_definitions(script: str) -> dict[str, str]:
    """name -> source of each top-level def, class and NAME = ... assignment (the __main__ block is the algorithm's
    driver, where the scripts are meant to differ)."""
    with open(os.path.join(ROOT, script)) as f:
        source = f.read()
    definitions = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            definitions[node.name] = ast.get_source_segment(source, node)
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            for target in node.targets:
                definitions[target.id] = ast.get_source_segment(source, node)
    return definitions


DEFINITIONS = {script: top_level_definitions(script) for script in SCRIPTS}
SHARED = sorted({name for a in SCRIPTS for b in SCRIPTS if a < b for name in DEFINITIONS[a].keys() & DEFINITIONS[b].keys()})


def test_the_scripts_share_the_algorithm():
    assert len(SCRIPTS) >= 2 and len(SHARED) > 50  # this guard would pass vacuously on scripts that share nothing
    for name in ["rloo_advantages", "policy_loss", "completion_logprobs", "per_token_kl", "RunGuard", "Logger"]:
        assert name in SHARED


@pytest.mark.parametrize("name", [n for n in SHARED if n not in INTENDED_DIFFERENCES])
def test_a_shared_definition_is_identical_in_every_script(name):
    sources = {script: DEFINITIONS[script][name] for script in SCRIPTS if name in DEFINITIONS[script]}
    first_script, first = next(iter(sources.items()))
    for script, source in sources.items():
        assert source == first, (f"{name} differs between {first_script} and {script}: make the fix in every script, or "
                                 "name the difference in INTENDED_DIFFERENCES with its reason")


@pytest.mark.parametrize("name", sorted(INTENDED_DIFFERENCES))
def test_every_intended_difference_is_real(name):
    """The list stays short and true: a name listed here really differs somewhere."""
    sources = {DEFINITIONS[script][name] for script in SCRIPTS if name in DEFINITIONS[script]}
    assert len(sources) > 1, f"{name} is the same in every script: take it off INTENDED_DIFFERENCES"
