"""What a path option names: a local path or a hub id (--model_name_or_path, --dataset_name, ... take either), and
whether two of them name the same place."""

import os


def looks_local(path: str) -> bool:
    """A path that cannot be a hub id: absolute, relative with ./ or ../, ~, or a file name with an extension we
    read."""
    return path.startswith(("/", "./", "../", "~")) or path.endswith(
        (".gguf", ".jsonl", ".json", ".parquet", ".csv", ".py")
    )


def same_path(a: str, b: str) -> bool:
    """Whether two path options name the same model or data: the same text, or local paths to the same place."""
    return a == b or looks_local(a) and looks_local(b) and os.path.abspath(a) == os.path.abspath(b)
