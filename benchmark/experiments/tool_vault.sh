#!/usr/bin/env bash
# (f) Tools: a task that only a tool solves (benchmark/tool_vault.py): the tiny Llama, warm-started on conversations
# of a weak tool user, learns to open each prompt's vault (an environment, one per rollout) and say the word inside.
# A policy that does not call the tool scores 1/8 at best. 3 seeds with rloo.py, about 2 minutes each on 2 CPU cores,
# after building the policy and the data into tool_vault/ (about 3 minutes; no download).
#
#   bash benchmark/experiments/tool_vault.sh        # extra arguments go to benchmark/launch.py
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d tool_vault ] || python benchmark/tool_vault.py --out tool_vault
python benchmark/launch.py --num_seeds 3 --workers 1 \
    --command "python rloo.py --model_name_or_path tool_vault/policy --dataset_name tool_vault/data \
--environment benchmark/tool_vault.py:Vault --reward_funcs benchmark/tool_vault.py:said_the_word \
--max_tool_calling_iterations 1 --total_episodes 1920 --num_generations 8 --per_device_train_batch_size 32 \
--max_completion_length 96 --learning_rate 2e-4 --beta 0 --num_sample_generations 0 --num_generations_eval 4 \
--exp_name rloo_tool_vault" "$@"

cat <<PLOT
Curves from the local runs:
python benchmark/plot.py --runs runs --regex '^(rloo_tool_vault)__' \\
    --metrics reward tools/call_frequency eval/reward completions/mean_length --output benchmark/results/tool_vault.png
PLOT
