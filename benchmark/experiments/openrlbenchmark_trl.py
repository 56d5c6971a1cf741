"""Print the openrlbenchmark command that plots this project's runs next to TRL's public RLOO runs.

TRL's RLOO docs plot their TL;DR runs (Pythia-1B, `benchmark/experiments/tldr.sh` is the same experiment here) with
openrlbenchmark's filter `?we=huggingface&wpn=trl&xaxis=train/episode&ceik=output_dir&cen=sft_model_path` and 14
metrics. Our runs carry other config keys (a run's output folder is its own here, so runs are told apart by
dataset_name and exp_name), so they come in a second filter group over the same x-axis and metric names; every
group is one line of curves in each of the 14 panels.

    python benchmark/experiments/openrlbenchmark_trl.py --entity my-team            # prints the command
    python benchmark/experiments/openrlbenchmark_trl.py --entity my-team | bash     # runs it (W&B login needed)

openrlbenchmark needs an environment of its own (its pins clash with this project's rich and tyro):
    python -m venv .venv-openrlbenchmark && .venv-openrlbenchmark/bin/pip install -r benchmark/requirements-openrlbenchmark.txt
and the printed command is run with that environment's python.
"""

import argparse
import os
import shlex

# TRL's metric names, which every script logs under the same names (train/<name> in W&B)
METRICS = [
    "objective/rlhf_reward",
    "objective/scores",
    "objective/kl",
    "objective/non_score_reward",
    "objective/entropy",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/num_eos_tokens",
    "lr",
    "eps",
]
# TRL's public runs, as its RLOO docs select them: the project, and one group per SFT model
TRL_FILTER = "?we=huggingface&wpn=trl&xaxis=train/episode&ceik=output_dir&cen=sft_model_path"
TRL_GROUP = "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr?tag=pr-1540"
TRL_ENV_ID = "models/minimal/rloo_tldr"


def command(
    entity: str, project: str, exp_names: list[str], env_id: str, tag: str, output_filename: str, python: str
) -> list[str]:
    """The command's arguments, one filter group for TRL's runs and one for ours."""
    metrics = "".join(f"&metrics=train/{m}" for m in METRICS)
    ours = f"?we={entity}&wpn={project}&xaxis=train/episode&ceik=dataset_name&cen=exp_name{metrics}"
    return [
        python,
        "-m",
        "openrlbenchmark.rlops_multi_metrics",
        "--filters",
        TRL_FILTER + metrics,
        TRL_GROUP,
        "--env-ids",
        TRL_ENV_ID,
        "--filters",
        ours,
        *[name + (f"?tag={tag}" if tag else "") for name in exp_names],
        "--env-ids",
        env_id,
        "--pc.ncols",
        "4",
        "--pc.ncols-legend",
        "1",
        "--pc.xlabel",
        "Episode",
        "--output-filename",
        output_filename,
        "--scan-history",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--entity",
        default=os.environ.get("WANDB_ENTITY", "your-entity"),
        help="the W&B entity of your runs (default: $WANDB_ENTITY)",
    )
    parser.add_argument(
        "--project", default="rloo", help="the W&B project of your runs (the scripts' --wandb_project_name)"
    )
    parser.add_argument(
        "--exp_names",
        nargs="+",
        default=["rloo_vllm", "rloo_multigpu"],
        help="the exp_name of each group of runs (the scripts' file names, by default)",
    )
    parser.add_argument(
        "--env_id",
        default="trl-internal-testing/tldr-preference-sft-trl-style",
        help="the --dataset_name of your runs (TL;DR, as TRL's runs)",
    )
    parser.add_argument("--tag", default="", help="only runs with this W&B tag (benchmark/launch.py --pr N gives pr-N)")
    parser.add_argument(
        "--output_filename",
        default="benchmark/results/trl_openrlbenchmark",
        help="where the PNG (and openrlbenchmark's other outputs) go, without extension",
    )
    parser.add_argument(
        "--python",
        default=".venv-openrlbenchmark/bin/python",
        help="the python that has openrlbenchmark (an environment of its own)",
    )
    args = parser.parse_args()
    words = command(args.entity, args.project, args.exp_names, args.env_id, args.tag, args.output_filename, args.python)
    # one option per line, as in TRL's docs
    lines, current = [], words[:3]
    for word in words[3:]:
        if word.startswith("--"):
            lines.append(current)
            current = []
        current.append(word)
    lines.append(current)
    print(" \\\n    ".join(shlex.join(line) for line in lines))


if __name__ == "__main__":
    main()
