"""The train and validation files checked before Ray starts: rows verl would train on silently.

verl 0.9.1 reads ``data.train_files`` and ``data.val_files`` only once its workers are up, and then trains on what it
finds: an empty prompt is generated from, a ``reward_model`` of null or a ``ground_truth`` of None is scored against
the string ``"None"``, and a ``data_source`` its scorer does not know raises inside the reward loop, where the sample
is replaced by padding. :func:`check_data` refuses such files first, with one line naming the file, the row and the
column (and how many rows share the problem):

- a missing file, or one without the columns ``prompt``, ``data_source`` and ``reward_model``;
- an empty prompt: null, an empty chat, or chat messages whose contents are all blank;
- ``reward_model`` null, or its ``ground_truth`` missing or null;
- a ``data_source`` the run's scorer does not know: the scorer verl would use (``reward.custom_reward_function``, or
  verl's ``default_compute_score``) is called once per distinct source with an empty response and that source's first
  ground truth, and any exception (``NotImplementedError`` is what verl's scorer raises for an unknown source) refuses
  the file.

Only the three columns are read (pyarrow), and the per-row work is a pass over Python lists: a 17 k-row DAPO-Math
file takes about a second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from omegaconf import DictConfig, ListConfig, OmegaConf

COLUMNS = ("prompt", "data_source", "reward_model")


class DataCheckError(ValueError):
    """A data file the run must not train or validate on, in one line."""


def _files(value: Any) -> list[Path]:
    if value is None:
        return []
    items = list(value) if isinstance(value, list | tuple | ListConfig) else [value]
    return [Path(str(item)).expanduser() for item in items]


def _empty_prompt(prompt: Any) -> bool:
    if prompt is None:
        return True
    if isinstance(prompt, str):
        return not prompt.strip()
    if isinstance(prompt, list):
        contents = [m.get("content") if isinstance(m, dict) else m for m in prompt]
        return not any(isinstance(c, str) and c.strip() for c in contents)
    return False


def _missing_ground_truth(reward_model: Any) -> str | None:
    if reward_model is None:
        return "reward_model is null"
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        return "reward_model has no ground_truth"
    if reward_model["ground_truth"] is None:
        return "reward_model.ground_truth is null (verl would score against the string 'None')"
    return None


def _first(rows: Iterable[int], path: Path, column: str, what: str) -> None:
    rows = list(rows)
    if rows:
        more = f" (and {len(rows) - 1} more rows)" if len(rows) > 1 else ""
        raise DataCheckError(f"{path}: row {rows[0]}, column {column}: {what}{more}")


def scorer(config: DictConfig) -> tuple[Callable[..., Any], str]:
    """The scoring function verl's reward loop calls for ``config``, and its name for messages."""
    custom = OmegaConf.select(config, "reward.custom_reward_function", default=None) or {}
    if custom.get("path"):
        from verl.utils.import_utils import load_extern_object

        function = load_extern_object(module_path=custom["path"], object_name=custom.get("name") or "compute_score")
        kwargs = dict(custom.get("reward_kwargs") or {})
        return (lambda *a, **k: function(*a, **kwargs, **k)), f"{custom['path']}:{custom.get('name')}"
    from verl.utils.reward_score import default_compute_score

    return default_compute_score, "verl's default_compute_score"


def check_file(path: Path, score: Callable[..., Any] | None = None, score_name: str = "the scorer") -> int:
    """Check one parquet file (see the module docstring); returns its row count.

    Raises:
        DataCheckError: the first problem found, in one line.
    """
    if not path.is_file():
        raise DataCheckError(f"{path}: no such file")
    names = pq.read_schema(path).names
    absent = [c for c in COLUMNS if c not in names]
    if absent:
        raise DataCheckError(f"{path}: no column(s) {absent} (verl's RLHF format needs {list(COLUMNS)})")
    table = pq.read_table(path, columns=list(COLUMNS))
    prompts = table.column("prompt").to_pylist()
    _first((i for i, p in enumerate(prompts) if _empty_prompt(p)), path, "prompt", "empty prompt")
    rewards = table.column("reward_model").to_pylist()
    problems = [(i, why) for i, r in enumerate(rewards) if (why := _missing_ground_truth(r))]
    if problems:
        _first((i for i, _ in problems), path, "reward_model", problems[0][1])
    sources = table.column("data_source").to_pylist()
    _first((i for i, s in enumerate(sources) if not s), path, "data_source", "data_source is empty or null")
    if score is not None:
        first_row: dict[str, int] = {}
        for i, source in enumerate(sources):
            first_row.setdefault(source, i)
        for source, row in first_row.items():
            try:
                score(source, "", rewards[row]["ground_truth"], extra_info={})
            except Exception as exc:  # any failure of the probe: the scorer cannot score this source
                count = sum(s == source for s in sources)
                more = f" (and {count - 1} more rows)" if count > 1 else ""
                raise DataCheckError(
                    f"{path}: row {row}, column data_source: {score_name} does not score data_source={source!r} "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}){more}"
                ) from None
    return table.num_rows


def check_data(config: DictConfig) -> None:
    """Check every file of ``data.train_files`` and ``data.val_files`` (see the module docstring).

    Raises:
        DataCheckError: the first problem found, in one line naming the file, the row and the column.
    """
    files = _files(OmegaConf.select(config, "data.train_files")) + _files(OmegaConf.select(config, "data.val_files"))
    if not files:
        return
    score, name = scorer(config)
    for path in files:
        check_file(path, score, name)
