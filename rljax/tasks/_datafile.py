"""Reading one local data file through HF ``datasets``, offline only.

``read_rows(path)`` gives the column names and the rows as dicts. Errors name
the file (and, for a JSON-lines syntax error, the line) instead of showing
``datasets``' traceback.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
import pathlib

# Builder of ``datasets.load_dataset`` for each accepted file ending.
_BUILDERS = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json",
             ".json.gz": "json", ".parquet": "parquet", ".csv": "csv",
             ".csv.gz": "csv"}


def _import_datasets():
    # Offline before the first import: datasets and huggingface_hub read these
    # when imported, and a hub name must fail at once instead of retrying.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError as err:
        raise ValueError("the dataset task needs the 'datasets' package: pip "
                         "install 'rljax[data]' (or pip install datasets)") from err
    # Already imported elsewhere (before the variables were set): same switch.
    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    return datasets


def _builder(path: str) -> str:
    name = path.lower()
    for ending in sorted(_BUILDERS, key=len, reverse=True):
        if name.endswith(ending):
            return _BUILDERS[ending]
    raise ValueError(f"dataset: path={path!r} has an unknown file type; valid "
                     f"endings: {', '.join(_BUILDERS)}")


def _open_text(path: str):
    if path.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _json_lines_problem(path: str) -> str:
    """The first line that is not a JSON object, as 'line N: why' (or '')."""
    with _open_text(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as err:
                return f"line {number}: invalid JSON ({err})"
            if not isinstance(value, dict):
                return (f"line {number}: a JSON {type(value).__name__}, not an "
                        f"object")
    return ""


def read_rows(path: str) -> tuple[list[str], list[dict]]:
    """(columns, rows) of a local file; ValueError naming ``path`` otherwise."""
    if not isinstance(path, str) or not path:
        raise ValueError("dataset: path is required (a local .jsonl, .json, "
                         ".parquet or .csv file)")
    if not pathlib.Path(path).is_file():
        raise ValueError(
            f"dataset: path={path!r} is not a local file; the dataset task "
            f"reads local files only ({', '.join(_BUILDERS)}), offline, never "
            f"a hub name: download the file and pass its path")
    builder = _builder(path)
    datasets = _import_datasets()
    kwargs = {}
    if builder == "csv":
        # Every CSV cell as text: type inference would turn the answer "007"
        # into 7; and an empty cell is "" (an empty prompt), not NaN.
        with _open_text(path) as f:
            header = next(csv.reader(f), None)
        if not header:
            raise ValueError(f"dataset {path}: the CSV file has no header row")
        kwargs = dict(keep_default_na=False, features=datasets.Features(
            {name: datasets.Value("string") for name in header}))
    try:
        table = datasets.load_dataset(builder, data_files=path, split="train",
                                      **kwargs)
    except Exception as err:  # noqa: BLE001 - reported with the file's name
        lines = path.lower().endswith((".jsonl", ".jsonl.gz"))
        detail = _json_lines_problem(path) if lines else ""
        cause = err.__cause__ or err.__context__ or err
        raise ValueError(
            f"dataset {path}: cannot read it as {builder}"
            f"{': ' + detail if detail else ''} ({type(cause).__name__}: "
            f"{str(cause)[:300]})") from None
    return list(table.column_names), table.to_list()


def sha256(path: str) -> str:
    """The file's SHA-256, so a run directory records exactly which data it saw."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
