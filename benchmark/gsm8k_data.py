"""GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems") as prompt files for the scripts: each
question as a chat prompt with veRL's instruction, its `answer` the number after the solution's "####", its
`data_source` "gsm8k". Reads the hub dataset (openai/gsm8k, config main: 7,473 train and 1,319 test problems) or
local files in its schema (columns question and answer), and writes <out>/train.jsonl and <out>/test.jsonl:

    python benchmark/gsm8k_data.py --out data/gsm8k                        # needs the hub (datasets)
    python benchmark/gsm8k_data.py --source path/to/gsm8k --out data/gsm8k # a folder with train and test files

The recipe that trains on them: benchmark/experiments/gsm8k.sh."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for rloo_utils

from rloo_utils.data import DATA_FORMATS  # noqa: E402
from rloo_utils.errors import UsageError, describe  # noqa: E402
from rloo_utils.verifiable import marked_number  # noqa: E402

# veRL's examples/data_preprocess/gsm8k.py: the question, then this (its reported accuracies use it)
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def load_split(source: str, split: str):
    """One split of GSM8K: the hub id (config main), or a local folder whose file names are the splits."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors come back as one line
    if os.path.isdir(source):
        files = [f for f in sorted(os.listdir(source)) if os.path.splitext(f)[0] == split]
        files = [f for f in files if os.path.splitext(f)[1] in DATA_FORMATS]
        if not files:
            raise UsageError(f"{source} has no {split} file (.jsonl, .json, .parquet or .csv): give one per split")
        path, kind = os.path.join(source, files[0]), DATA_FORMATS[os.path.splitext(files[0])[1]]
        if os.path.getsize(path) == 0:
            raise UsageError(f"{path} is empty: the {split} split needs GSM8K rows (question, answer)")
        try:
            return datasets.load_dataset(kind, data_files=path, split="train")
        except Exception as e:  # a malformed file: one line
            raise UsageError(f"could not read {path} as {kind}: {describe(e)}") from None
    try:
        return datasets.load_dataset(source, "main", split=split)
    except Exception as e:  # no hub, an unknown id: one line
        raise UsageError(f"could not load {source} (config main, split {split}): {describe(e)}") from None


def prompt_rows(dataset) -> list[dict]:
    """GSM8K rows (question, a worked solution ending "#### <answer>") -> prompt rows for the scripts."""
    missing = {"question", "answer"} - set(dataset.column_names)
    if missing:
        raise UsageError(f"the GSM8K data has no column {sorted(missing)[0]!r}: it needs question and answer")
    rows = []
    for i, (question, solution) in enumerate(zip(dataset["question"], dataset["answer"])):
        answer = marked_number(solution)
        if answer is None:
            raise UsageError(f"row {i} of the GSM8K data has no '#### <number>' in its answer: {solution[-60:]!r}")
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "answer": int(answer) if answer.denominator == 1 else float(answer),
                "data_source": "gsm8k",
            }
        )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="openai/gsm8k", help="the hub id, or a local folder in its schema")
    parser.add_argument("--out", required=True, help="the folder to write train.jsonl and test.jsonl to")
    args = parser.parse_args()
    try:
        for split in ("train", "test"):
            if os.path.exists(os.path.join(args.out, f"{split}.jsonl")):
                raise UsageError(f"{args.out} already holds {split}.jsonl: give a new --out (nothing is overwritten)")
        splits = {split: prompt_rows(load_split(args.source, split)) for split in ("train", "test")}
        for split, rows in splits.items():
            if not rows:
                raise UsageError(f"the {split} split of {args.source} has no rows: nothing to train or evaluate on")
    except UsageError as e:
        sys.exit(f"error: {e}")
    os.makedirs(args.out, exist_ok=True)
    # each file whole or absent (written aside, then renamed), train.jsonl last: gsm8k.sh takes a folder holding it as
    # prepared, so a kill midway leaves none that looks done
    for split in ("test", "train"):
        path = os.path.join(args.out, f"{split}.jsonl")
        with open(path + ".partial", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in splits[split])
        os.replace(path + ".partial", path)
    print(f"{len(splits['train'])} train and {len(splits['test'])} test problems written to {args.out}")
