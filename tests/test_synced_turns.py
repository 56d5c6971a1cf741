"""rloo_multigpu.py's multi-turn rollouts with HF generate on 2 processes and a static KV cache (the default on CUDA):
under synced_gpus a process whose rows have ended steps on with the others, so every process's turn is as long as the
longest (BaseSampler.turn_length); a cache sized for its own shorter turn overflowed (an index error on the process
with a 1-token turn, its context at the end of a 64-token bucket)."""

import datetime
import os
import types

import pytest
import torch

from conftest import free_port, join_processes


def a_turn_on_each_process(rank: int, port: int, tiny: dict, results: str) -> None:
    """Rank 0: a turn of 1 token after a 63-token context (its static cache: 64 + 1 positions), as a process whose
    rollouts have all ended makes; rank 1: a turn of up to 8 tokens after a short one. Greedy, so that the turns can
    be compared with the dynamic cache's."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rloo_utils.sharded_sampling import ShardedSampler
    from test_static_cache import LENGTHS, plain_configs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny["policy"])
    eos = tokenizer.eos_token_id
    models = types.SimpleNamespace(tokenizer=tokenizer, processor=None)
    plan = types.SimpleNamespace(tool_use=None, image_column=None)
    sampler = ShardedSampler(
        policy,
        None,
        models,
        plan,
        [eos],
        [eos],
        torch.device("cpu"),
        forward_batch_size=4,
        gather_for_generation=False,  # (a plain model: nothing to gather)
        num_generations=1,
        seed=1,
        **LENGTHS,
    )
    context = [10 + (i * 7) % 50 for i in range(63 if rank == 0 else 5)]
    budgets = [1] if rank == 0 else [8]
    outcomes = {}
    for static in (True, False):
        _, greedy, _ = plain_configs(eos, tokenizer.pad_token_id, static)
        outcomes[static] = sampler.next_turn([context], budgets, [0], 0, greedy, None)[0][0]
    torch.save(outcomes, f"{results}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow  # two processes start, each compiling the decoding step
def test_two_processes_turns_of_different_lengths_on_a_static_cache(tiny, tmp_path):
    import torch.multiprocessing as mp

    results = str(tmp_path / "turn")
    context = mp.start_processes(
        a_turn_on_each_process, args=(free_port(), tiny, results), nprocs=2, start_method="spawn", join=False
    )
    join_processes(context, 300)
    turns = [torch.load(f"{results}.{rank}") for rank in (0, 1)]
    assert len(turns[0][True]) == 1 and 1 <= len(turns[1][True]) <= 8
    for rank in (0, 1):
        assert turns[rank][True] == turns[rank][False]  # the static cache's greedy turn is the dynamic cache's


@pytest.mark.slow  # torchrun starts 2 processes
def test_fsdp_mixed_precision_keeps_the_static_cache(tiny, prompts_file, tmp_path):
    """Under --bf16 FSDP2 gathers the weights in bfloat16 and generation computes in that one dtype, so
    rloo_multigpu.py keeps the static cache there (rloo.py needs a bfloat16 copy for it); it used to fall back, saying
    that --bf16 computes over float32 weights."""
    from test_multigpu import run_torchrun

    rewards = os.path.join(os.path.dirname(__file__), "reward_fixtures.py")

    proc = run_torchrun(
        2,
        *("--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file, "--total_episodes", 16),
        *("--reward_funcs", f"{rewards}:text_length", "--per_device_train_batch_size", 4, "--bf16"),
        *("--cache_implementation", "static", "--max_completion_length", 8),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dynamic KV cache" not in proc.stdout + proc.stderr
