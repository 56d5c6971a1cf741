#!/usr/bin/env bash
# (g) GSM8K on a GPU: Qwen2.5-0.5B-Instruct trained with RLOO on openai/gsm8k's 7,473 training problems, rewarded 1
# for the right number after "####" (gsm8k_accuracy, veRL's strict parse), evaluated greedily on the 1,319 test problems
# (pass@1) before training and every tenth of the run; beside it the flexible parse's accuracy (the last number,
# eval/answer_accuracy/mean@1), which tells a wrong answer from a missing "####". Needs a GPU and the hub; rloo_vllm.py
# samples with vLLM colocated on the GPU.
#
#   bash benchmark/experiments/gsm8k.sh                 # extra arguments go to benchmark/launch.py (--pr 12, --dry_run)
#   MODEL=Qwen/Qwen2.5-1.5B-Instruct bash benchmark/experiments/gsm8k.sh
#
# The published run it follows: veRL's PPO baseline for Qwen2.5-0.5B-Instruct on GSM8K (verl docs/algo/baseline.md:
# 56.7; its log eric-haibin-lin/verl-data@a7e3f99, gsm8k/Qwen2.5-0.5B-bsz256_2-prompt1024-resp512-0.567.log: test
# accuracy 0.00076 before training, 0.5686 after 435 steps): 256 prompts per update in 4 minibatches of 64, prompts up
# to 1,024 tokens and responses up to 512, actor learning rate 1e-6, in-reward KL coefficient 0.001, 15 epochs (435
# updates), temperature 1, the same prompt (veRL's instruction after the question) and the same strict score. What
# differs, RLOO being critic-free: 4 completions of each prompt (the leave-one-out baseline in place of PPO's critic
# and GAE; PPO samples 1), so an update trains on 1,024 completions. Its accuracy is the number to compare with; this
# recipe's own has not been measured (docs/verifiable.md says what has).
#
# MODEL, SOURCE (the GSM8K hub id, or a local folder in its schema), DATA (where the prompt files go; relative paths
# are from the repo's root), SCRIPT, SEEDS and EXTRA (options appended last, which win) change it; the GPU kit's short
# version (benchmark/gpu/check.py, part rloo_gsm8k) runs this file with SCRIPT=rloo.py, a model it has, a few updates.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
SOURCE=${SOURCE:-openai/gsm8k}
DATA=${DATA:-data/gsm8k}
SCRIPT=${SCRIPT:-rloo_vllm.py}
if [ ! -f "$DATA/train.jsonl" ] && [[ " $* " != *" --dry_run "* ]]; then
    python benchmark/gsm8k_data.py --source "$SOURCE" --out "$DATA"
fi
# launch.py runs the command through the shell: paths quoted
GSM8K="--model_name_or_path $(printf %q "$MODEL") --dataset_name $(printf %q "$DATA") --reward_funcs gsm8k_accuracy \
--max_prompt_length 1024 --max_completion_length 512 --temperature 1.0 \
--num_generations 4 --per_device_train_batch_size 16 --gradient_accumulation_steps 16 --num_mini_batches 4 \
--total_episodes 445440 --learning_rate 1e-6 --beta 0.001 --bf16 --gradient_checkpointing \
--eval_steps 0.1 --eval_temperature 0 --num_generations_eval 1 --eval_success_threshold 1 \
--eval_metric_funcs answer_accuracy --track"
python benchmark/launch.py --num_seeds "${SEEDS:-1}" --workers 1 \
    --command "python $(printf %q "$SCRIPT") $GSM8K ${EXTRA:-}" "$@"

cat <<PLOT
Held-out accuracy (greedy pass@1 on the 1,319 test problems) and the training reward, from the local runs:
python benchmark/plot.py --runs runs --regex '^${SCRIPT%.py}__' \\
    --metrics eval/pass@1 eval/answer_accuracy/mean@1 reward kl completions/mean_length --output benchmark/results/gsm8k.png
PLOT
