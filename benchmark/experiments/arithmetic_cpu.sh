#!/usr/bin/env bash
# (v) A verifiable reward on a CPU: SmolLM2-135M-Instruct answers one-digit arithmetic (data/arithmetic, written by
# data/arithmetic/make.py: 240 train and 60 test problems of +, - and *), rewarded 1 where the last number of its
# completion is the answer (answer_accuracy). 40 updates of 32 completions (4 prompts x 8), up to 16 tokens; held-out
# evaluation on the 60 test problems before training and every 10 updates, 8 completions each at temperature 1 (pass@1
# and pass@8, per operation), and greedy completions of all 60 in the sample tables (greedy pass@1: their mean
# reward).
# Over 3 seeds with rloo.py and rloo_vllm.py (colocated vLLM engine), one run at a time, each on every core (an update
# takes about 21 s on 2 cores; docs/verifiable.md). Without a W&B account, set WANDB_MODE=offline.
#
#   bash benchmark/experiments/arithmetic_cpu.sh      # extra arguments go to benchmark/launch.py (--pr 12, --dry_run)
set -euo pipefail
cd "$(dirname "$0")/../.."
ARITHMETIC="--dataset_name data/arithmetic --reward_funcs answer_accuracy --max_completion_length 16 \
--num_generations 8 --per_device_train_batch_size 32 --total_episodes 1280 --learning_rate 3e-5 --beta 0.02 \
--eval_steps 10 --num_generations_eval 8 --eval_success_threshold 1 --num_sample_prompts 60 --track"
python benchmark/launch.py --num_seeds 3 --workers 1 \
    --command "python rloo.py $ARITHMETIC" \
    --command "python rloo_vllm.py $ARITHMETIC" "$@"

tag=$(git describe --tags --always --dirty)
cat <<PLOT
Held-out accuracy and the training reward from the local runs (runs/*/metrics.jsonl):
python benchmark/plot.py --runs runs --regex '^(rloo|rloo_vllm)__' \\
    --metrics eval/pass@1 eval/pass@8 reward completions/mean_length --output benchmark/results/arithmetic_cpu.png

The held-out accuracy at the first and last evaluation of each run (greedy pass@1 from the sample tables, pass@k):
python benchmark/accuracy_table.py --runs runs --regex '^(rloo|rloo_vllm)__'

From W&B (openrlbenchmark 0.3.1 in an environment of its own, benchmark/requirements-openrlbenchmark.txt; replace ?we=... with your entity, and the tag with --pr's pr-N if given):
.venv-openrlbenchmark/bin/python -m openrlbenchmark.rlops_multi_metrics \\
    --filters '?we=${WANDB_ENTITY:-your-entity}&wpn=rloo&xaxis=train/episode&ceik=dataset_name&cen=exp_name&metrics=train/reward&metrics=train/kl&metrics=train/completions/mean_length' \\
        "rloo?tag=$tag" "rloo_vllm?tag=$tag" \\
    --env-ids data/arithmetic \\
    --pc.ncols 3 \\
    --pc.ncols-legend 1 \\
    --pc.xlabel "Episode" \\
    --output-filename benchmark/results/arithmetic_cpu_openrlbenchmark \\
    --scan-history
PLOT
