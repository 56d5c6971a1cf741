#!/usr/bin/env bash
# (v) DAPO's dynamic sampling on the arithmetic task of arithmetic_cpu.sh (SmolLM2-135M-Instruct, data/arithmetic,
# answer_accuracy, groups of 8, the same learning rate, KL and held-out evaluation), rloo.py over 3 seeds, with and
# without --dynamic_sampling, compared at equal generated tokens, not equal updates: dynamic sampling generates more
# per update (the groups it drops, and the prompts sampled in their place). Its runs train on 896 completions (28
# updates of 32) where the plain runs train on 1280 (40 updates); measured, they generated about twice the tokens
# (docs/verifiable.md), so accuracy_table.py --at_tokens reads every run at the same number of tokens. Evaluation every
# 10 updates (plain) and every 7 (dynamic): 5 points each. One run at a time, on every core (about 13.5 and 14 minutes
# a run on 2 cores).
#
#   bash benchmark/experiments/arithmetic_dynamic_cpu.sh      # extra arguments go to benchmark/launch.py (--dry_run)
set -euo pipefail
cd "$(dirname "$0")/../.."
ARITHMETIC="--dataset_name data/arithmetic --reward_funcs answer_accuracy --max_completion_length 16 \
--num_generations 8 --per_device_train_batch_size 32 --learning_rate 3e-5 --beta 0.02 --num_generations_eval 8 \
--eval_success_threshold 1 --num_sample_prompts 60"
python benchmark/launch.py --num_seeds 3 --workers 1 \
    --command "python rloo.py $ARITHMETIC --total_episodes 1280 --eval_steps 10 --exp_name arith_plain" \
    --command "python rloo.py $ARITHMETIC --total_episodes 896 --eval_steps 7 --dynamic_sampling \
--exp_name arith_dynamic" "$@"

cat <<PLOT
Held-out accuracy and the share of groups dropped, against the tokens generated (runs/*/metrics.jsonl):
python benchmark/plot.py --runs runs --regex '^(arith_plain|arith_dynamic)__' --x generated \\
    --metrics eval/pass@1 reward sampling/frac_groups_zero_std --output benchmark/results/arithmetic_dynamic_cpu.png

The held-out accuracy at the first and last evaluation of each run, and where every run had generated 11,300 tokens:
python benchmark/accuracy_table.py --runs runs --regex '^(arith_plain|arith_dynamic)__'
python benchmark/accuracy_table.py --runs runs --regex '^(arith_plain|arith_dynamic)__' --at_tokens 11300

From W&B (with --track; openrlbenchmark 0.3.1 in an environment of its own, benchmark/requirements-openrlbenchmark.txt):
.venv-openrlbenchmark/bin/python -m openrlbenchmark.rlops_multi_metrics \\
    --filters '?we=\${WANDB_ENTITY:-your-entity}&wpn=rloo&xaxis=train/episode&ceik=dataset_name&cen=exp_name&metrics=train/reward&metrics=train/sampling/frac_groups_zero_std' \\
        "arith_plain?tag=\$(git describe --tags --always --dirty)" "arith_dynamic?tag=\$(git describe --tags --always --dirty)" \\
    --env-ids data/arithmetic --pc.ncols 2 --output-filename benchmark/results/arithmetic_dynamic_openrlbenchmark --scan-history
PLOT
