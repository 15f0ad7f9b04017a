"""Shared by the dapo-math and eval-math preparations: reading a local file or an HF dataset, and writing
verl's RL parquet schema.

verl's ``RLHFDataset`` (verl/utils/dataset/rl_dataset.py) reads ``prompt`` (a chat list) and passes
``data_source``, ``reward_model`` (``ground_truth``, ``style``) and ``extra_info`` (``index``) through to the
reward manager, which picks the verifier by ``data_source`` (``math_dapo`` and ``aime*`` go to the DAPO math
verifier, reward +1 / -1).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# The authors' preprocessing (recipe/is_shape/tools/preprocess_datasets.py of the published code) appends an
# instruction to each problem after one space, with no other change to the problem text. Training problems and
# AMC23 get PROMPT_SUFFIX; AIME24 and AIME25 get AIME_SUFFIX.
PROMPT_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
AIME_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."
SUFFIX_SEPARATOR = " "

# DAPO-Math-17k wraps each problem in its own answer-format instruction. The authors' code deletes this exact
# prefix and replaces this exact postfix by SUFFIX_SEPARATOR + PROMPT_SUFFIX (plain string replacements).
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_POSTFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
# Looser forms of the same template (other copies of the dataset), removed when the exact strings are absent.
_DAPO_PREFIX = re.compile(r"^\s*Solve the following math problem step by step\..*?\n\n", re.DOTALL)
_DAPO_POSTFIX = re.compile(r"\n*\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")

VERL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string()), ("source", pa.string())])),
    ]
)
LOCAL_SUFFIXES = (".parquet", ".json", ".jsonl")


class DataError(ValueError):
    """Input that cannot be turned into verl's schema; the message names the file/dataset and what is wrong."""


def load_rows(source: str, config: str | None = None, split: str = "train") -> list[dict]:
    """Rows of a local ``.parquet`` / ``.json`` / ``.jsonl`` file, or of an HF dataset ``source`` (name)."""
    path = Path(source).expanduser()
    if path.suffix in LOCAL_SUFFIXES or path.exists():
        if not path.is_file():
            raise DataError(f"input file not found: {path}")
        if path.suffix == ".parquet":
            return pq.read_table(path).to_pylist()
        if path.suffix in (".json", ".jsonl"):
            import pandas as pd

            try:
                frame = pd.read_json(path, lines=path.suffix == ".jsonl")
            except ValueError as err:
                raise DataError(f"{path} is not valid {path.suffix[1:].upper()}: {err}") from err
            return frame.to_dict(orient="records")
        raise DataError(f"unsupported input file {path}: use one of {', '.join(LOCAL_SUFFIXES)}")
    import datasets

    try:
        return list(datasets.load_dataset(source, config, split=split))
    except Exception as err:  # datasets raises many types (network, missing config, missing split)
        raise DataError(f"cannot load dataset {source!r} (config {config!r}, split {split!r}): {err}") from err


def first_key(row: dict, keys: Iterable[str], what: str, where: str):
    for key in keys:
        if key in row and row[key] is not None:
            return row[key]
    raise DataError(f"{where}: no {what} column (looked for {', '.join(keys)}; found {', '.join(sorted(row))})")


def user_text(value) -> str:
    """The problem text from a plain string or a chat list ([{role, content}, ...])."""
    if isinstance(value, str):
        return value
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list | tuple):
        users = [m.get("content", "") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return users[-1]
    raise DataError(f"cannot read a problem from {type(value).__name__} {str(value)[:80]!r}")


def strip_dapo_template(text: str) -> str:
    """The problem inside DAPO's answer-format template, as the authors' replacements leave it (not stripped)."""
    if DAPO_PREFIX in text and text.endswith(DAPO_POSTFIX):
        return text.replace(DAPO_PREFIX, "")[: -len(DAPO_POSTFIX)]
    if _DAPO_PREFIX.search(text) or _DAPO_POSTFIX.search(text):
        return _DAPO_POSTFIX.sub("", _DAPO_PREFIX.sub("", text)).strip()
    return text


def with_suffix(problem: str, suffix: str = PROMPT_SUFFIX) -> str:
    """The prompt text the authors' preprocessing builds: the problem, one space, the instruction."""
    return f"{problem}{SUFFIX_SEPARATOR}{suffix}"


def answer_text(value) -> str:
    """Ground truth as a string; integral floats (AMC answers are often stored as 27.0) lose the '.0'."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def make_row(
    problem: str, answer: str, data_source: str, index: int, split: str, source: str, suffix: str = PROMPT_SUFFIX
) -> dict:
    if not problem.strip():
        raise DataError(f"{source} row {index}: empty problem")
    if not answer:
        raise DataError(f"{source} row {index}: empty answer")
    return {
        "data_source": data_source,
        "prompt": [{"content": with_suffix(problem, suffix), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": index, "split": split, "source": source},
    }


def write_parquet(rows: list[dict], output: str | Path) -> Path:
    output = Path(output).expanduser()
    output.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=VERL_SCHEMA), output)
    return output
