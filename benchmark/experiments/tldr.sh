#!/usr/bin/env bash
# (b) The seed's TL;DR experiment (seed 001): the Pythia-1B SFT and reward models of "The N+ implementation details
# of RLHF with PPO", 1M episodes, the seed's hyperparameters as the README's seed commands give them, over 3 seeds:
#   - on 1 GPU with rloo_vllm.py (vLLM colocated on the GPU): 16 x 16 x 2 = 512 completions per update;
#   - on 8 GPUs with rloo_multigpu.py (torchrun, FSDP2): old TRL's 16 x 16 x 2 x 8 = 4096 completions per update.
# Needs GPUs and the hub. On a Slurm cluster, write the 6 jobs instead of running them here (one job per run, with
# the GPUs its command takes):
#
#   bash benchmark/experiments/tldr.sh                                    # here, one run at a time
#   bash benchmark/experiments/tldr.sh --slurm_template benchmark/slurm_template.sh [--slurm_submit]
#
# The seed's --output_dir models/minimal/rloo_tldr is left out: an output folder belongs to one run (rloo.py refuses
# a second), so each run saves its model to runs/<run_name>/model; openrlbenchmark groups the runs by dataset_name
# and exp_name instead of output_dir and sft_model_path. Evaluate a trained model with benchmark/judge.py (below).
set -euo pipefail
cd "$(dirname "$0")/../.."
TLDR="--dataset_name trl-internal-testing/tldr-preference-sft-trl-style --dataset_test_split validation \
--num_ppo_epochs 2 --num_mini_batches 2 --learning_rate 3e-6 \
--per_device_train_batch_size 16 --gradient_accumulation_steps 16 --total_episodes 1000000 \
--model_name_or_path EleutherAI/pythia-1b-deduped --sft_model_path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr \
--reward_model_path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr --local_rollout_forward_batch_size 16 \
--missing_eos_penalty 1.0 --stop_token eos --kl_coef 0.03 \
--num_generations 2 --max_completion_length 53 --temperature 0.7 --max_grad_norm inf --track"
python benchmark/launch.py --num_seeds 3 --workers 1 \
    --command "python rloo_vllm.py $TLDR" \
    --command "torchrun --nproc_per_node 8 rloo_multigpu.py $TLDR" "$@"

tag=$(git describe --tags --always --dirty)
cat <<PLOT
Learning curves from the local runs:
python benchmark/plot.py --runs runs --regex '^(rloo_vllm|rloo_multigpu)__' \\
    --metrics objective/rlhf_reward objective/scores objective/kl completions/mean_length --output benchmark/results/tldr.png

From W&B (openrlbenchmark 0.3.1 in an environment of its own, benchmark/requirements-openrlbenchmark.txt; replace ?we=... with your entity, and the tag with --pr's pr-N if given):
.venv-openrlbenchmark/bin/python -m openrlbenchmark.rlops_multi_metrics \\
    --filters '?we=${WANDB_ENTITY:-your-entity}&wpn=rloo&xaxis=train/episode&ceik=dataset_name&cen=exp_name&metrics=train/objective/rlhf_reward&metrics=train/objective/scores&metrics=train/objective/kl&metrics=train/objective/non_score_reward&metrics=train/objective/entropy&metrics=train/policy/approxkl_avg&metrics=train/policy/clipfrac_avg&metrics=train/loss/policy_avg&metrics=train/policy/entropy_avg&metrics=train/val/ratio&metrics=train/val/ratio_var&metrics=train/val/num_eos_tokens&metrics=train/lr&metrics=train/eps' \\
        "rloo_vllm?tag=$tag" "rloo_multigpu?tag=$tag" \\
    --env-ids trl-internal-testing/tldr-preference-sft-trl-style \\
    --pc.ncols 4 \\
    --pc.ncols-legend 1 \\
    --pc.xlabel "Episode" \\
    --output-filename benchmark/results/tldr_openrlbenchmark \\
    --scan-history

Next to TRL's public RLOO runs of the same experiment (TRL's own filter group and ours, in one plot):
python benchmark/experiments/openrlbenchmark_trl.py --entity ${WANDB_ENTITY:-your-entity}${tag:+ --tag $tag}

Win rate against the reference TL;DRs (the seed's evaluation: 51.2% for TRL's RLOO model, 33.0% for the SFT model):
python benchmark/judge.py --model_name_or_path runs/<run_name>/model --dataset_name trl-lib/tldr --dataset_split test \\
    --judge_base_url https://api.openai.com/v1 --judge_model gpt-4o-mini --num_examples 1000
PLOT
