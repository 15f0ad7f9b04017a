"""The train and validation files checked before Ray starts: rows verl would train on, or score, silently.

verl 0.9.1 reads ``data.train_files`` and ``data.val_files`` only once its workers are up, and then uses what it
finds: an empty prompt becomes a sequence of padding that is generated from and trained on; a ``reward_model`` of
null or a ``ground_truth`` of None is scored against the string ``"None"``; a ``data_source`` the reward function
does not know raises in a reward worker at the first rollout, after the model is loaded on every node.
:func:`check_data` refuses such a file first, in one line naming the file, the row and the column, and how many
rows of that file share the problem.

Checked, for each file of ``data.train_files`` and ``data.val_files`` (a path or a list of paths, ``~`` expanded):
    - the file exists, and has the columns ``prompt`` (``data.prompt_key``), ``data_source`` and ``reward_model``;
    - no prompt is empty: null, an empty chat list, chat messages whose contents are all blank, or a blank string;
    - no ``reward_model`` is null or lacks its ``ground_truth`` (field missing, or null);
    - every distinct ``data_source`` is one the reward function verl will call (:func:`reward_function`) scores: it
      is called once per source with an empty response and that source's first ground truth, and any exception
      (``NotImplementedError`` is what verl's ``default_compute_score`` raises for an unknown source) refuses it.

Rows are counted from 0 within their file. Only those three columns are read, with pyarrow, and the row checks are
pyarrow.compute / numpy passes over whole columns: a 17k-row DAPO-Math file takes a fraction of a second, plus one
reward call per data source. A file that pyarrow cannot read (a damaged page included), a column of another type
(``data_source`` not a string, a prompt neither a string nor a chat list) and a ground truth that is NaN (verl would
score against the string ``"nan"``) are refused like the problems above. A remote path (``hdfs://`` or any other
``scheme://``, which verl copies or reads itself once the workers are up) is not checked, and :func:`check_data`
says so on stderr; a ``.json`` / ``.jsonl`` file is checked only for being there.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import DictConfig, ListConfig, OmegaConf

FILE_KEYS = ("data.train_files", "data.val_files")
PROMPT_KEY = "data.prompt_key"  # the column verl's RLHFDataset reads the prompt from
DEFAULT_PROMPT_COLUMN = "prompt"
DATA_SOURCE = "data_source"  # verl's reward managers read these two by name, not through a config key
REWARD_MODEL = "reward_model"
GROUND_TRUTH = "ground_truth"
EXTRA_INFO = "extra_info"
CONTENT = "content"
PARQUET_SUFFIX = ".parquet"
# A URL (hdfs://, s3://, ...): verl.utils.fs.copy_to_local, or the dataset reader, fetches it once the workers are up.
REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# verl 0.9.1's main_ppo reward keys (verl/trainer/config/reward/reward.yaml; verl/trainer/ppo/reward.py).
CUSTOM_REWARD_PATH = "reward.custom_reward_function.path"
REWARD_MANAGER_NAME = "reward.reward_manager.name"
REWARD_MODEL_ENABLE = "reward.reward_model.enable"  # without a custom function, a model scores and data_source is moot
PROBE_RESPONSE = ""
# The reward managers (naive, dapo) add these keys to each sample's extra_info before calling the reward function.
PROBE_EXTRA_INFO = {"num_turns": None, "rollout_reward_scores": {}}
MAX_ERROR_CHARS = 160  # an exception quoted "in a few words": its first line, cut to this length


class DataCheckError(ValueError):
    """A train or validation file verl would read wrongly; the message is one line naming file, row and column."""


def check_data(config: DictConfig, echo=None) -> list[str]:
    """Raise :class:`DataCheckError` for the first file of ``data.train_files`` / ``data.val_files`` with a problem.

    The message starts with the file; for each kind of problem in it, it names the first row, the column, what is
    wrong and how many more rows of the file have the same problem (``; `` between kinds). What is checked: the
    module docstring. The reward function is loaded (and verl imported) only when a file has a data source to probe.

    Args:
        config: the composed verl ``main_ppo`` job (``DictConfig``).
        echo: where the line about each remote file goes (default: stderr).

    Returns:
        The remote files, which were not checked.
    """
    if echo is None:
        echo = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    prompt_column = str(OmegaConf.select(config, PROMPT_KEY, default=None) or DEFAULT_PROMPT_COLUMN)
    probe = _SourceProbe(config)
    remote = []
    for key in FILE_KEYS:
        for path in _paths(OmegaConf.select(config, key, default=None)):
            if isinstance(path, str):
                remote.append(path)
                echo(f"data check: {path} is remote, not checked (verl reads it once the workers are up)")
                continue
            problems = _file_problems(path, prompt_column, probe)
            if problems:
                raise DataCheckError(f"{path}: " + "; ".join(problems))
    return remote


def reward_function(config: DictConfig) -> Callable[..., Any]:
    """The ``compute_score`` verl 0.9.1's reward manager calls (``verl.trainer.ppo.reward.load_reward_manager``).

    ``reward.custom_reward_function.path`` / ``.name`` (with its ``reward_kwargs``) through verl's own
    ``get_custom_reward_fn`` when a path is set, else ``get_default_compute_score(reward.reward_manager.name)``, i.e.
    ``verl.utils.reward_score.default_compute_score``. verl 0.9.1's main_ppo does not read the legacy top-level
    ``custom_reward_function`` (only its fully-async entry migrates it), so neither does this. The sandbox-fusion
    arguments verl binds when ``reward.sandbox_fusion.url`` is set are left out: a probe makes no network calls (code
    sources then go to verl's local ``prime_code`` scorer).

    Raises:
        DataCheckError: the custom reward function cannot be loaded.
    """
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.reward_score import get_default_compute_score

    if OmegaConf.select(config, CUSTOM_REWARD_PATH, default=None):
        try:
            return get_custom_reward_fn(config)
        except Exception as exc:  # verl raises FileNotFoundError, RuntimeError, AttributeError, AssertionError
            path = OmegaConf.select(config, CUSTOM_REWARD_PATH)
            raise DataCheckError(f"{CUSTOM_REWARD_PATH}={path}: cannot load it ({_few_words(exc)})") from None
    return get_default_compute_score(OmegaConf.select(config, REWARD_MANAGER_NAME, default=None))


@dataclass(frozen=True)
class _Problem:
    """One kind of problem in one column of a file: the rows (from 0, ascending) that have it."""

    column: str
    what: str
    rows: np.ndarray  # (R,) int

    def __str__(self) -> str:
        more = len(self.rows) - 1
        tail = f" (and {more} more row{'s' if more > 1 else ''})" if more else ""
        return f"row {int(self.rows[0])}, column {self.column}: {self.what}{tail}"


class _SourceProbe:
    """The reward function verl will call, called once per data source; the outcomes are kept across files."""

    def __init__(self, config: DictConfig):
        self._config = config
        self._fn: Callable[..., Any] | None = None
        self._errors: dict[Any, str | None] = {}
        custom = OmegaConf.select(config, CUSTOM_REWARD_PATH, default=None)
        self.enabled = bool(custom) or not OmegaConf.select(config, REWARD_MODEL_ENABLE, default=False)

    def error(self, source: Any, ground_truth: Any, extra_info: Any) -> str | None:
        """None when the reward function scores ``source``, else its exception in a few words."""
        if source not in self._errors:
            if self._fn is None:
                self._fn = reward_function(self._config)
            info = {**(extra_info if isinstance(extra_info, dict) else {}), **PROBE_EXTRA_INFO}
            try:
                result = self._fn(
                    data_source=source, solution_str=PROBE_RESPONSE, ground_truth=ground_truth, extra_info=info
                )
                if inspect.isawaitable(result):  # verl accepts an async reward function
                    asyncio.run(result)
                self._errors[source] = None
            except Exception as exc:  # any failure: verl's reward worker would fail on this source the same way
                self._errors[source] = _few_words(exc)
        return self._errors[source]


def _paths(value: Any) -> list[Path | str]:
    """Local files as paths (``~`` expanded); a URL stays the string it is (``Path`` would fold its ``//``)."""
    if value is None:
        return []
    values = list(value) if isinstance(value, ListConfig | list | tuple) else [value]
    return [str(v) if REMOTE.match(str(v)) else Path(str(v)).expanduser() for v in values]


def _file_problems(path: Path, prompt_column: str, probe: _SourceProbe) -> list[str]:
    if not path.is_file():
        return ["no such file"]
    if path.suffix != PARQUET_SUFFIX:
        return []
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowException, OSError) as exc:
        return [f"not a readable parquet file ({_few_words(exc)})"]
    columns = (prompt_column, DATA_SOURCE, REWARD_MODEL)
    absent = [c for c in columns if c not in names]
    if absent:
        return [f"no column {', '.join(absent)} (verl's RLHF format needs {', '.join(columns)}; found {names})"]
    try:  # a damaged page shows only when the data is read
        table = pq.read_table(path, columns=list(columns))
        return _table_problems(path, table, prompt_column, probe, EXTRA_INFO in names)
    except (pa.ArrowException, OSError) as exc:
        return [f"not a readable parquet file ({_few_words(exc)})"]


def _table_problems(path: Path, table: pa.Table, prompt_column: str, probe: _SourceProbe, has_extra: bool) -> list:
    prompts = table.column(prompt_column).combine_chunks()
    sources = table.column(DATA_SOURCE).combine_chunks()
    wrong = [
        f"column {name} is {array.type}, not {wanted}"
        for name, array, wanted, fits in (
            (prompt_column, prompts, "a string or a list of chat messages", _prompt_type_fits(prompts.type)),
            (DATA_SOURCE, sources, "a string", _is_string(sources.type) or pa.types.is_null(sources.type)),
        )
        if not fits
    ]
    if wrong:
        return wrong
    reward_model = table.column(REWARD_MODEL).combine_chunks()
    ground_truth = _ground_truth(reward_model)
    rm_null = reward_model.is_null().to_numpy(zero_copy_only=False)  # (N,)
    gt_null = ground_truth.is_null().to_numpy(zero_copy_only=False)  # (N,)
    gt_nan = _is_nan(ground_truth)  # (N,)
    problems = [
        _rows_where(prompt_column, "empty prompt", _empty_prompts(prompts)),
        _rows_where(REWARD_MODEL, "reward_model is null", rm_null),
        _rows_where(REWARD_MODEL, _ground_truth_problem(reward_model.type), ~rm_null & gt_null),
        _rows_where(REWARD_MODEL, "reward_model.ground_truth is NaN (verl would score against 'nan')", gt_nan),
        *_source_problems(path, sources.to_pylist(), ground_truth, ~gt_nan, probe, has_extra),
    ]
    return [str(p) for p in problems if p is not None]


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _prompt_type_fits(t: pa.DataType) -> bool:
    return _is_string(t) or pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_null(t)


def _is_nan(values: pa.Array) -> np.ndarray:
    """(N,) bool: a floating-point value that is NaN (false for null and for every other type)."""
    if not pa.types.is_floating(values.type):
        return np.zeros(len(values), dtype=bool)
    return pc.fill_null(pc.is_nan(values), False).to_numpy(zero_copy_only=False)


def _rows_where(column: str, what: str, mask: np.ndarray) -> _Problem | None:
    rows = np.flatnonzero(mask)
    return _Problem(column, what, rows) if len(rows) else None


def _ground_truth(reward_model: pa.Array) -> pa.Array:
    """(N,) the ``ground_truth`` of each row; null where the struct, its field or the value is missing."""
    if pa.types.is_struct(reward_model.type) and reward_model.type.get_field_index(GROUND_TRUTH) >= 0:
        return pc.struct_field(reward_model, GROUND_TRUTH)
    # No such field, or not a struct (a map or a JSON string): verl's reward_model["ground_truth"] fails on every row.
    return pa.nulls(len(reward_model))


def _ground_truth_problem(reward_model_type: pa.DataType) -> str:
    if not pa.types.is_struct(reward_model_type):
        return f"reward_model is {reward_model_type}, not a struct with a ground_truth field"
    if reward_model_type.get_field_index(GROUND_TRUTH) < 0:
        return "reward_model has no ground_truth field"
    return "reward_model.ground_truth is null (verl would score against the string 'None')"


def _empty_prompts(prompts: pa.Array) -> np.ndarray:
    """(N,) bool: the prompt is null, an empty chat list, chat messages of blank contents, or a blank string."""
    if pa.types.is_string(prompts.type) or pa.types.is_large_string(prompts.type):
        return ~_non_blank(prompts)
    listed = pa.types.is_list(prompts.type) or pa.types.is_large_list(prompts.type)
    message = prompts.type.value_type if listed else None
    if message is not None and pa.types.is_struct(message) and message.get_field_index(CONTENT) >= 0:
        content = message.field(CONTENT).type
        if pa.types.is_string(content) or pa.types.is_large_string(content):
            # Parents from the offsets, not pc.list_parent_indices: pyarrow 26 counts the values under a null list
            # there but leaves them out of pc.list_flatten, so those two disagree.
            offsets = prompts.offsets.to_numpy()  # (N+1,)
            parents = np.repeat(np.arange(len(prompts)), np.diff(offsets))  # (M,)
            messages = prompts.values.slice(offsets[0], offsets[-1] - offsets[0])  # (M,)
            non_blank = _non_blank(pc.struct_field(messages, CONTENT))  # (M,)
            has_text = np.bincount(parents[non_blank], minlength=len(prompts)) > 0  # (N,)
            return ~has_text | prompts.is_null().to_numpy(zero_copy_only=False)
    return np.array([_is_empty_prompt(v) for v in prompts.to_pylist()], dtype=bool)


def _non_blank(strings: pa.Array) -> np.ndarray:
    lengths = pc.utf8_length(pc.utf8_trim_whitespace(strings))
    return pc.fill_null(pc.greater(lengths, 0), False).to_numpy(zero_copy_only=False)


def _is_empty_prompt(value: Any) -> bool:
    """The same test on one Python value, for prompt layouts the columnar path does not cover."""
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list):
        return not any(isinstance(m, dict) and isinstance(m.get(CONTENT), str) and m[CONTENT].strip() for m in value)
    return False


def _source_problems(
    path: Path,
    sources: list[Any],
    ground_truth: pa.Array,
    usable: np.ndarray,
    probe: _SourceProbe,
    has_extra_info: bool,
) -> list[_Problem | None]:
    """Null data_source values, and each data_source the reward function refuses (probed at its first row that has
    a ground truth, with that row's extra_info)."""
    sources_np = np.array(sources, dtype=object)  # (N,)
    problems = [_rows_where(DATA_SOURCE, "data_source is null", sources_np == None)]  # noqa: E711 (elementwise)
    if not probe.enabled:
        return problems
    gt_known = ~ground_truth.is_null().to_numpy(zero_copy_only=False) & usable  # (N,)
    first_row: dict[Any, int] = {}
    for row, source in enumerate(sources):
        if source is not None and gt_known[row]:
            first_row.setdefault(source, row)
    if not first_row:
        return problems
    rows = list(first_row.values())
    truths = ground_truth.take(rows).to_pylist()
    infos: list[Any] = [None] * len(rows)
    if has_extra_info:
        infos = pq.read_table(path, columns=[EXTRA_INFO]).column(0).take(rows).to_pylist()
    for source, truth, info in zip(first_row, truths, infos, strict=True):
        error = probe.error(source, truth, info)
        if error is not None:
            what = f"data_source {source!r} is not scored by the reward function ({error})"
            problems.append(_Problem(DATA_SOURCE, what, np.flatnonzero(sources_np == source)))
    return problems


def _few_words(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
