"""A cheap check of the train and validation parquet files, run by the entry point before Ray starts.

verl reads malformed rows without complaint and fails late or not at all: an empty prompt becomes a sequence of
padding that is trained on; a ``reward_model`` without a ``ground_truth`` reaches the reward function as the string
``"None"`` once verl's batch has been through numpy; a ``data_source`` the reward function does not know raises in a
reward worker at the first rollout, after the model has been loaded on every node. :func:`check_data` refuses such a
file up front, with one line naming the file, the row and the column.

Checked, per file of ``data.train_files`` and ``data.val_files`` (a path or a list of paths, ``~`` expanded):
    - the file exists; a ``.parquet`` file has the columns ``data.prompt_key`` (``prompt``), ``data_source`` and
      ``reward_model``;
    - no prompt is empty: null, an empty chat list, chat messages whose contents are all blank, or a blank string;
    - no ``reward_model`` is null and none lacks its ``ground_truth`` (field missing or null);
    - every distinct ``data_source`` is known to the reward function verl will use (see :func:`_reward_function`):
      it is called once per source with an empty response and that source's first ground truth, and any exception
      (``NotImplementedError`` from verl's ``default_compute_score``) means the source is not known.

Rows are indexed from 0 within their file (``pyarrow.parquet.read_table(path).slice(row, 1)`` shows one). Only the
needed columns are read, with pyarrow; a 17k-row DAPO-Math file takes well under a second, plus one reward call per
data source. Non-local paths (``hdfs://``, which verl copies itself) and ``.json`` / ``.jsonl`` files are checked no
further than being present.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import DictConfig, ListConfig, OmegaConf

FILE_KEYS = ("data.train_files", "data.val_files")
PROMPT_KEY = "data.prompt_key"  # verl's RLHFDataset reads the prompt from this column
DEFAULT_PROMPT_COLUMN = "prompt"
DATA_SOURCE = "data_source"  # verl's reward managers read these two columns by name, not through a config key
REWARD_MODEL = "reward_model"
GROUND_TRUTH = "ground_truth"
PARQUET_SUFFIX = ".parquet"
REMOTE_PREFIXES = ("hdfs://",)  # verl.utils.fs.copy_to_local fetches these; they cannot be read from here
# verl 0.9.1's main_ppo reward keys (verl/trainer/config/reward/reward.yaml, verl/trainer/ppo/reward.py).
CUSTOM_REWARD_PATH = "reward.custom_reward_function.path"
REWARD_MANAGER_NAME = "reward.reward_manager.name"
REWARD_MODEL_ENABLE = "reward.reward_model.enable"  # a model-scored job does not call the rule function
PROBE_RESPONSE = ""
# The naive reward manager adds these two keys to every sample's extra_info before it calls the reward function.
PROBE_EXTRA_INFO = {"num_turns": None, "rollout_reward_scores": {}}
MAX_ERROR_CHARS = 160  # an exception quoted "in a few words": its first line, cut to this length


class DataCheckError(ValueError):
    """A train or validation file verl would read wrongly; the message is one line naming file, row and column."""


def check_data(config: DictConfig) -> None:
    """Raise :class:`DataCheckError` for the first file of ``data.train_files`` / ``data.val_files`` with a problem.

    The message names the config key, the file, and for each kind of problem found in that file the first row, the
    column, what is wrong and how many more rows have the same problem. What is checked: the module docstring.

    Args:
        config: the composed verl ``main_ppo`` job (``DictConfig``).
    """
    probe = _SourceProbe(config)
    for key in FILE_KEYS:
        for path in _paths(OmegaConf.select(config, key, default=None)):
            problems = _file_problems(path, _prompt_column(config), probe)
            if problems:
                raise DataCheckError(f"{key}: {path}: " + "; ".join(problems))


@dataclass(frozen=True)
class _Problem:
    """One kind of problem in one column: the rows (0-based, ascending) that have it."""

    column: str
    what: str
    rows: np.ndarray  # (R,) int

    def __str__(self) -> str:
        more = len(self.rows) - 1
        tail = f" (and {more} more row{'s' if more > 1 else ''})" if more else ""
        return f"row {int(self.rows[0])}, column {self.column!r}: {self.what}{tail}"


def _paths(value: Any) -> list[Path]:
    if value is None:
        return []
    values = list(value) if isinstance(value, ListConfig | list | tuple) else [value]
    return [Path(str(v)).expanduser() for v in values]


def _prompt_column(config: DictConfig) -> str:
    return str(OmegaConf.select(config, PROMPT_KEY, default=None) or DEFAULT_PROMPT_COLUMN)


def _file_problems(path: Path, prompt_column: str, probe: _SourceProbe) -> list[str]:
    if str(path).startswith(REMOTE_PREFIXES):
        return []
    if not path.is_file():
        return ["file not found"]
    if path.suffix != PARQUET_SUFFIX:
        return []
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowException, OSError) as exc:
        return [f"not a readable parquet file ({_few_words(exc)})"]
    columns = (prompt_column, DATA_SOURCE, REWARD_MODEL)
    missing = [c for c in columns if c not in names]
    if missing:
        return [f"no column {', '.join(map(repr, missing))} (columns: {', '.join(names)})"]
    table = pq.read_table(path, columns=list(columns))
    rm = table.column(REWARD_MODEL).combine_chunks()
    ground_truth = _ground_truth(rm)
    problems = [
        _rows_where(prompt_column, "empty prompt", _empty_prompts(table.column(prompt_column).combine_chunks())),
        _rows_where(REWARD_MODEL, "null", rm.is_null().to_numpy(zero_copy_only=False)),
        _rows_where(
            REWARD_MODEL,
            f"{GROUND_TRUTH} missing or null",
            ~rm.is_null().to_numpy(zero_copy_only=False) & _is_null(ground_truth),
        ),
        *_unknown_sources(path, table.column(DATA_SOURCE).to_pylist(), ground_truth, probe, "extra_info" in names),
    ]
    return [str(p) for p in problems if p is not None]


def _rows_where(column: str, what: str, mask: np.ndarray) -> _Problem | None:
    rows = np.flatnonzero(mask)
    return _Problem(column, what, rows) if len(rows) else None


def _is_null(array: pa.Array | None) -> np.ndarray:
    """(N,) bool; None stands for a column without the field, null in every row."""
    if array is None:
        return np.ones(0, dtype=bool)
    return array.is_null().to_numpy(zero_copy_only=False)


def _ground_truth(rm: pa.Array) -> pa.Array:
    """The ``ground_truth`` of each row (null where the struct, the field or the value is missing)."""
    if pa.types.is_struct(rm.type):
        if rm.type.get_field_index(GROUND_TRUTH) >= 0:
            return pc.struct_field(rm, GROUND_TRUTH)
        return pa.nulls(len(rm))
    # Other layouts (a map column, say): look each row up in Python.
    values = [_as_dict(v).get(GROUND_TRUTH) for v in rm.to_pylist()]
    return pa.array(values, type=pa.string() if all(v is None or isinstance(v, str) for v in values) else None)


def _as_dict(value: Any) -> dict:
    if isinstance(value, dict):
        return value
    if isinstance(value, list) and all(isinstance(v, tuple) and len(v) == 2 for v in value):
        return dict(value)  # pyarrow's to_pylist of a map value
    return {}


def _empty_prompts(prompts: pa.Array) -> np.ndarray:
    """(N,) bool: the prompt is null, an empty chat list, a chat list of blank contents, or a blank string."""
    if pa.types.is_string(prompts.type) or pa.types.is_large_string(prompts.type):
        return ~_non_blank(prompts)
    item = prompts.type.value_type if pa.types.is_list(prompts.type) or pa.types.is_large_list(prompts.type) else None
    if item is not None and pa.types.is_struct(item) and item.get_field_index("content") >= 0:
        content = item.field("content").type
        if pa.types.is_string(content) or pa.types.is_large_string(content):
            # Parents from the offsets, not pc.list_parent_indices: pyarrow 26 counts the values under a null list
            # there but not in pc.list_flatten, so the two can disagree.
            offsets = prompts.offsets.to_numpy()  # (N+1,)
            parents = np.repeat(np.arange(len(prompts)), np.diff(offsets))  # (M,)
            messages = prompts.values.slice(offsets[0], offsets[-1] - offsets[0])  # (M,)
            non_blank = _non_blank(pc.struct_field(messages, "content"))  # (M,)
            has_text = np.bincount(parents[non_blank], minlength=len(prompts)) > 0  # (N,)
            return ~has_text | prompts.is_null().to_numpy(zero_copy_only=False)
    return np.array([_is_empty_prompt(v) for v in prompts.to_pylist()], dtype=bool)


def _non_blank(strings: pa.Array) -> np.ndarray:
    lengths = pc.utf8_length(pc.utf8_trim_whitespace(strings))
    return pc.fill_null(pc.greater(lengths, 0), False).to_numpy(zero_copy_only=False)


def _is_empty_prompt(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list):
        return not any(isinstance(m, dict) and str(m.get("content") or "").strip() for m in value)
    return False


def _unknown_sources(
    path: Path, sources: list, ground_truth: pa.Array, probe: _SourceProbe, has_extra_info: bool
) -> list[_Problem | None]:
    """A problem for null data_source values, and one per data_source the reward function refuses."""
    sources_np = np.array(sources, dtype=object)
    problems = [_rows_where(DATA_SOURCE, "null", sources_np == None)]  # noqa: E711 (elementwise)
    if not probe.enabled:
        return problems
    gt_known = ~_is_null(ground_truth)
    first: dict[Any, int] = {}
    for row, source in enumerate(sources):
        if source is not None and gt_known[row]:
            first.setdefault(source, row)
    if not first:
        return problems
    rows = list(first.values())
    ground_truths = ground_truth.take(rows).to_pylist()
    extra = [None] * len(rows)
    if has_extra_info:
        extra = pq.read_table(path, columns=["extra_info"]).column(0).take(rows).to_pylist()
    for (source, row), gt, info in zip(first.items(), ground_truths, extra, strict=True):
        error = probe.error(source, gt, info)
        if error is not None:
            same = np.flatnonzero(sources_np == source)
            problems.append(_Problem(DATA_SOURCE, f"{source!r} is not known to the reward function ({error})", same))
    return problems


class _SourceProbe:
    """The reward function verl will use, called once per data source (results kept across files)."""

    def __init__(self, config: DictConfig):
        self._config = config
        self._fn = None
        self._errors: dict[Any, str | None] = {}
        custom = OmegaConf.select(config, CUSTOM_REWARD_PATH, default=None)
        self.enabled = bool(custom) or not OmegaConf.select(config, REWARD_MODEL_ENABLE, default=False)

    def error(self, source: Any, ground_truth: Any, extra_info: Any) -> str | None:
        """None when the reward function scores ``source``, else its exception in a few words."""
        if source not in self._errors:
            info = {**(extra_info if isinstance(extra_info, dict) else {}), **PROBE_EXTRA_INFO}
            try:
                result = self._function()(
                    data_source=source, solution_str=PROBE_RESPONSE, ground_truth=ground_truth, extra_info=info
                )
                if inspect.isawaitable(result):
                    asyncio.run(result)
                self._errors[source] = None
            except DataCheckError:
                raise
            except Exception as exc:  # any failure: verl's reward worker would fail on this source the same way
                self._errors[source] = _few_words(exc)
        return self._errors[source]

    def _function(self):
        if self._fn is None:
            self._fn = _reward_function(self._config)
        return self._fn


def _reward_function(config: DictConfig):
    """The ``compute_score`` verl 0.9.1's reward manager calls (``verl.trainer.ppo.reward.load_reward_manager``).

    ``reward.custom_reward_function.path`` / ``name`` (with its ``reward_kwargs``) when a path is set, else
    ``get_default_compute_score(reward.reward_manager.name)``, i.e. ``default_compute_score``. The sandbox-fusion
    arguments verl binds when ``reward.sandbox_fusion.url`` is set are left out: a probe makes no network calls
    (code sources then fall back to verl's local ``prime_code`` scorer).

    Raises:
        DataCheckError: the custom reward function cannot be loaded.
    """
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.reward_score import get_default_compute_score

    try:
        custom = get_custom_reward_fn(config)
    except Exception as exc:  # verl raises FileNotFoundError, RuntimeError, AttributeError, AssertionError
        path = OmegaConf.select(config, CUSTOM_REWARD_PATH)
        raise DataCheckError(
            f"{CUSTOM_REWARD_PATH}={path}: cannot load the reward function ({_few_words(exc)})"
        ) from None
    return custom or get_default_compute_score(OmegaConf.select(config, REWARD_MANAGER_NAME, default=None))


def _few_words(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
