"""Prompt datasets: a hub id, or local files of one split each; their prompts (text or chat messages, images beside
them) checked when loaded; the batches of prompts of each update."""

import io
import itertools
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from rloo_utils.errors import UsageError, describe

# The default --dataset_name: this folder's movie-review openings, named relative to it so that a run's config (the env
# id openrlbenchmark groups runs by) is the same on every machine
EMBEDDED_DATASET = "data/movie_reviews"


@dataclass
class DataOptions:
    """The prompts: a dataset and its splits (TRL's ScriptArguments names)"""

    dataset_name: str = EMBEDDED_DATASET
    """a hub dataset id, or a local .jsonl/.json/.parquet/.csv file or a folder of them (one split per file name)"""
    dataset_train_split: str = "train"
    """the split to train on"""
    dataset_test_split: str = "test"
    """the held-out split: evaluation and sample tables (none: no evaluation, sample tables from the train split)"""


def dataset_path(name: str) -> str:
    """--dataset_name as a path to read: the embedded dataset is found next to the scripts from any working folder."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name)  # rloo_utils/..
    return here if name == EMBEDDED_DATASET and not os.path.exists(name) else name


DATA_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


# The arguments a script passes to every reward function: a data column of the same name would collide with one
REWARD_FUNC_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def row_batches(num_rows: int, prompts_per_rollout: int, seed: int, skip: int):
    """Endless stream of each rollout's dataset rows (every process's), reshuffled every pass over the data, from batch
    number `skip` on (a resumed run replays the shuffles, so it sees the prompts the uninterrupted run would have
    seen)."""

    def index_batches():
        generator = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(num_rows, generator=generator).tolist()
            for start in range(0, len(order) - prompts_per_rollout + 1, prompts_per_rollout):
                yield order[start : start + prompts_per_rollout]
            if len(order) < prompts_per_rollout:  # a tiny dataset: sample with replacement
                yield torch.randint(len(order), (prompts_per_rollout,), generator=generator).tolist()

    return itertools.islice(index_batches(), skip, None)


def prompt_batches(dataset, prompts_per_rollout: int, seed: int, skip: int, rank: int = 0, world_size: int = 1):
    """row_batches' prompts: of each batch, this process's share."""
    for rows in row_batches(len(dataset), prompts_per_rollout, seed, skip):
        yield dataset[rows[rank * prompts_per_rollout // world_size : (rank + 1) * prompts_per_rollout // world_size]]


class FirstRoundRows:
    """The rows of each update's first round (every process's): batch update - 1 of row_batches, the stream the scripts'
    prompt_batches draw each update's prompts from. The stream is kept while the updates come in order, and replayed
    from its start for any other (a resumed run's first update)."""

    def __init__(self, num_rows: int, seed: int):
        self.num_rows, self.seed, self.stream, self.next = num_rows, seed, None, None

    def __call__(self, update: int, prompts_per_rollout: int) -> list[int]:
        if self.next != (update, prompts_per_rollout):
            self.stream = row_batches(self.num_rows, prompts_per_rollout, self.seed, skip=update - 1)
        self.next = (update + 1, prompts_per_rollout)
        return next(self.stream)


def repeated(batch: dict, n: int) -> tuple[list, dict]:
    """A batch's prompts, each n times in a row (a group: its n completions adjacent, rows [g*n, (g+1)*n)), and its
    other columns alike, what reward functions get beside each completion."""
    prompts = [p for p in batch["prompt"] for _ in range(n)]
    columns = {c: [v for v in values for _ in range(n)] for c, values in batch.items() if c != "prompt"}
    return prompts, columns


def resampled_prompts(
    dataset,
    num_prompts: int,
    seed: int,
    update: int,
    round_: int,
    rank: int = 0,
    world_size: int = 1,
    drawn: Optional[set] = None,
):
    """--dynamic_sampling's prompts for one more round of an update: num_prompts per process, drawn without replacement
    (with it from a dataset too small), a function of (--seed, update, round, drawn) only, so that a resumed run draws
    what the uninterrupted one drew without a stream to checkpoint; of them, this process's share. drawn: the rows the
    update drew before (every process's), drawn again only once the others run out (a dropped prompt would likely be
    dropped again); this round's rows are added to it."""
    generator = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, update, round_]).generate_state(1)[0]))
    total, drawn = num_prompts * world_size, set() if drawn is None else drawn
    if total <= len(dataset):
        order = torch.randperm(len(dataset), generator=generator).tolist()
        rows = ([row for row in order if row not in drawn] + [row for row in order if row in drawn])[:total]
    else:
        rows = torch.randint(len(dataset), (total,), generator=generator).tolist()
    drawn.update(rows)
    return dataset[rows[rank * num_prompts : (rank + 1) * num_prompts]]


def load_prompt_dataset(name: str, split: str):
    """A datasets.Dataset with a "prompt" column; every other column is handed to the reward functions."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors come back as one line from here
    if os.path.isfile(name) or os.path.isdir(name):
        files = [name] if os.path.isfile(name) else sorted(os.path.join(name, f) for f in os.listdir(name))
        files = [f for f in files if os.path.splitext(f)[1] in DATA_FORMATS]
        if not files:
            raise UsageError(f"--dataset_name {name} holds no {'/'.join(DATA_FORMATS)} file")
        if os.path.isfile(name):
            data_files = {split: files}
        else:  # a folder: one split per file name, `train.jsonl` or `train-00000-of-00002.parquet` -> "train"
            data_files = defaultdict(list)
            for f in files:
                data_files[os.path.basename(f).split(".")[0].split("-")[0]].append(f)
        if split not in data_files:
            return None
        formats = {DATA_FORMATS[os.path.splitext(f)[1]] for f in data_files[split]}
        if len(formats) > 1:
            raise UsageError(
                f"split {split} of {name} mixes file formats ({', '.join(map(os.path.basename, data_files[split]))}): "
                "keep one format per split"
            )
        fmt = formats.pop()
        for f in data_files[split]:
            check_data_file(f, fmt)
        try:
            dataset = datasets.load_dataset(fmt, data_files={split: data_files[split]}, split=split)
        except Exception as e:  # a csv with only a header, invalid JSON...
            while e.__cause__ is not None:  # datasets wraps the parser's error: name that one
                e = e.__cause__
            raise UsageError(f"dataset {name} (split {split}) is empty or unreadable ({describe(e)})") from None
    else:
        try:
            dataset = datasets.load_dataset(name, split=split)
        except ValueError:  # unknown split
            return None
        except Exception as e:
            raise UsageError(f"could not load dataset {name} ({describe(e)})") from None
    where = f"dataset {name} (split {split})"
    if "prompt" not in dataset.column_names:
        raise UsageError(f"{where} has no 'prompt' column; its columns are {dataset.column_names}")
    if len(dataset) == 0:
        raise UsageError(f"{where} is empty")
    for column in REWARD_FUNC_ARGUMENTS:
        if column in dataset.column_names:
            raise UsageError(
                f"{where} has a column {column!r}, the name of an argument every reward function gets "
                f"({', '.join(REWARD_FUNC_ARGUMENTS)}): rename the column"
            )
    check_prompts(dataset["prompt"], where)
    column = image_column(dataset.column_names, where)
    if column:
        local = os.path.isfile(name) or os.path.isdir(name)
        dataset = with_images(dataset, column, where, os.path.dirname(data_files[split][0]) if local else os.getcwd())
    return dataset


def load_datasets(
    *, dataset_name: str, dataset_train_split: str, dataset_test_split: str, chat_template_kwargs: Optional[dict]
):
    """The train split, and the held-out split (None where there is none: a single file is one split); both hold
    prompts of one kind (strings, or chat messages). dataset_name: a hub id, a folder or a file (--dataset_name);
    dataset_train_split, dataset_test_split: the splits' names; chat_template_kwargs (--chat_template_kwargs): refused
    with plain-string prompts, which no chat template renders."""
    path = dataset_path(dataset_name)
    train = load_prompt_dataset(path, dataset_train_split)
    if train is None:
        raise UsageError(f"dataset {dataset_name} has no split {dataset_train_split!r} (--dataset_train_split)")
    test = None if os.path.isfile(path) else load_prompt_dataset(path, dataset_test_split)
    if test is not None and is_chat(test[0]["prompt"]) != is_chat(train[0]["prompt"]):
        raise UsageError(
            f"dataset {dataset_name}: the prompts of split {dataset_test_split} and of split "
            f"{dataset_train_split} are not of one kind (strings, or chat messages)"
        )
    if chat_template_kwargs and not is_chat(train[0]["prompt"]):
        raise UsageError(
            f"--chat_template_kwargs goes to the chat template, but the prompts of {dataset_name} "
            "are plain strings, which are tokenized without one: give chat prompts (lists of messages), "
            "or leave it out"
        )
    return train, test


def check_data_file(path: str, fmt: str) -> None:
    """An empty file, or a text file that is not UTF-8, named before datasets gives a vaguer error."""
    if os.path.getsize(path) == 0:
        raise UsageError(f"data file {path} is empty")
    if fmt in ("json", "csv"):
        with open(path, encoding="utf-8") as f:
            try:
                while f.read(1 << 24):
                    pass
            except UnicodeDecodeError as e:
                raise UsageError(f"data file {path} is not UTF-8 text ({e.reason}): save it as UTF-8") from None


def is_chat(prompt) -> bool:
    """A list of chat messages, each a dict with a string 'role' and a 'content' that is a string or (vision-language
    prompts, as TRL's) a list of parts {"type": "text", "text": ...} and {"type": "image"}."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and is_content(m.get("content")) for m in prompt)
    )


def is_content(content) -> bool:
    return (
        isinstance(content, str)
        or isinstance(content, list)
        and all(
            isinstance(part, dict)
            and (part.get("type") == "image" or part.get("type") == "text" and isinstance(part.get("text"), str))
            for part in content
        )
    )


def check_prompts(prompts: list, where: str) -> None:
    """Every prompt is a non-empty string, or every prompt is a list of chat messages."""
    chat = is_chat(prompts[0])
    for i, prompt in enumerate(prompts):
        if is_chat(prompt) if chat else isinstance(prompt, str) and prompt.strip():
            continue
        shown = repr(prompt) if len(repr(prompt)) <= 80 else repr(prompt)[:77] + "..."
        kind = "a list of chat messages with string 'role' and 'content'" if chat else "a non-empty string"
        raise UsageError(
            f"{where}: prompt {i} is {shown}, but the prompts must each be {kind} (as prompt 0 is)"
            if i
            else f"{where}: prompt 0 is {shown}; a prompt must be a non-empty string or a list of "
            "chat messages with string 'role' and 'content'"
        )


def left_pad(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and 0/1 mask of token lists of any lengths, padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


IMAGE_COLUMNS = ("image", "images")  # one image per row, or a list


def image_column(column_names: list[str], where: str) -> Optional[str]:
    found = [c for c in IMAGE_COLUMNS if c in column_names]
    if len(found) > 1:
        raise UsageError(f"{where} has both an 'image' and an 'images' column: keep one (one image per row, or a list)")
    return found[0] if found else None


def row_images(value) -> list:
    return value if isinstance(value, list) else [value]


def with_images(dataset, column: str, where: str, base_dir: str):
    """The image column as datasets' Image feature (PIL images when read), every image checked readable now rather
    than at the update that meets it. A path in a data file is relative to that file's folder; URLs are not fetched
    (give files, or a dataset whose column is already an Image feature)."""
    import PIL.Image
    from datasets import Image, List

    if not is_chat(dataset[0]["prompt"]):
        raise UsageError(
            f"{where} has an {column!r} column, but its prompts are plain strings: images go with chat "
            "prompts (lists of messages), as in TRL"
        )
    raw = (
        dataset.cast_column(column, Image(decode=False) if column == "image" else List(Image(decode=False)))
        if is_image_feature(dataset.features[column])
        else dataset
    )
    resolved = []
    for i, (prompt, value) in enumerate(zip(dataset["prompt"], raw[column])):
        items = row_images(value) if value is not None else []
        if not items:
            raise UsageError(
                f"{where}: row {i} has no image in its {column!r} column; every row needs one (the vision "
                "tower runs on every batch): drop the row, or the column"
            )
        placeholders = sum(
            part.get("type") == "image" for m in prompt if isinstance(m["content"], list) for part in m["content"]
        )
        if placeholders not in (0, len(items)):
            raise UsageError(
                f"{where}: prompt {i} holds {placeholders} image placeholders for {len(items)} images: give "
                'one {"type": "image"} part per image, or none (then they go before the first user text)'
            )
        paths = []
        for item in items:
            if isinstance(item, dict) and item.get("bytes"):
                source, shown = io.BytesIO(item["bytes"]), f"image bytes of row {i}"
            else:
                path = item.get("path") if isinstance(item, dict) else item
                if not isinstance(path, str) or path.startswith(("http://", "https://")):
                    raise UsageError(
                        f"{where}: row {i}'s image is {str(path)[:80]!r}, not a file: give image files "
                        "(paths relative to the data file), or download the images first"
                    )
                path = source = shown = os.path.join(base_dir, os.path.expanduser(path))
                if os.path.isdir(path):
                    raise UsageError(
                        f"{where}: image {path} (row {i}) is a folder, not an image file: give the file of each image"
                    )
                if not os.path.isfile(path):
                    raise UsageError(f"{where}: image file {path} (row {i}) does not exist")
                paths.append(path)
            try:
                with PIL.Image.open(source) as image:
                    image.verify()
            except Exception as e:
                raise UsageError(f"{where}: {shown} (row {i}) is not a readable image ({describe(e)})") from None
        resolved.append(paths if column == "images" else paths[0] if paths else None)
    if not is_image_feature(dataset.features[column]):
        dataset = dataset.remove_columns(column).add_column(column, resolved)
    return dataset.cast_column(column, Image() if column == "image" else List(Image()))


def is_image_feature(feature) -> bool:
    return type(feature).__name__ == "Image" or type(getattr(feature, "feature", None)).__name__ == "Image"


def text_prompts(prompts: list) -> list:
    """The prompts with their text only (image parts dropped): a text probe of a vision-language policy."""
    return [p if isinstance(p, str) else [{**m, "content": content_text(m["content"])} for m in p] for p in prompts]


def content_text(content) -> str:
    """The text of a message's content: a string, or its text parts joined (image parts dropped)."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p.get("type") == "text")


def with_image_placeholders(prompt: list[dict], num_images: int) -> list[dict]:
    """The messages with content as lists of parts, as a VLM's chat template reads them; where the prompt holds no
    image part, num_images of them go before the text of the first user message (TRL's prepare_multimodal_messages)."""
    messages = [
        {
            **m,
            "content": [{"type": "text", "text": m["content"]}]
            if isinstance(m["content"], str)
            else [p if p.get("type") == "text" else {"type": "image"} for p in m["content"]],
        }
        for m in prompt
    ]
    if not any(p["type"] == "image" for m in messages for p in m["content"]):
        first_user = next((m for m in messages if m["role"] == "user"), messages[0])
        first_user["content"] = [{"type": "image"}] * num_images + first_user["content"]
    return messages


def message_text(message) -> str:
    """A prompt or completion is a string, or (conversational data) a list of chat messages: take the last one."""
    return message if isinstance(message, str) else content_text(message[-1]["content"])
