"""respo_verl.data.check: real parquet files in verl's RLHF schema (respo_verl.data.common), the composed jobs of
the entry point (verl's default_compute_score; the ``+device=cpu`` preset's kit reward), and the real reward functions
loaded as verl loads them."""

from __future__ import annotations

import copy
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf, open_dict

from respo_verl.cpu.kit.task import DATA_SOURCE as KIT_SOURCE
from respo_verl.data.check import DataCheckError, check_data
from respo_verl.data.common import VERL_SCHEMA, make_row, write_parquet
from respo_verl.run.compose import compose_job

DAPO_ROWS = 17_000  # DAPO-Math-17k's size
ROW_GROUP = 1_000  # several row groups, so the columns are read back in several chunks
UNKNOWN_SOURCE = "amc23"  # verl 0.9.1's default_compute_score has no AMC branch


def _rows(n: int = 6, source: str = "math_dapo") -> list[dict]:
    return [make_row(f"What is {i} + 1?", str(i + 1), source, i, "train", "test") for i in range(n)]


@pytest.fixture(scope="module")
def default_job():
    """The entry point's job with verl's default reward function (no custom_reward_function.path)."""
    return compose_job("respo", ["algorithm=respo"])


@pytest.fixture(scope="module")
def cpu_job():
    """The ``+device=cpu`` job: reward.custom_reward_function.path=pkg://respo_verl.cpu.kit.reward."""
    return compose_job("respo", ["algorithm=respo", "+device=cpu"])


def _with_files(job, train, val=()):
    cfg = copy.deepcopy(job)
    cfg.data.train_files = str(train)
    cfg.data.val_files = [str(v) for v in val]
    return cfg


def _refusal(cfg) -> str:
    with pytest.raises(DataCheckError) as err:
        check_data(cfg)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_good_files_pass_with_verls_default_scorer(tmp_path, monkeypatch):
    train = write_parquet(_rows(), tmp_path / "train.parquet")
    aime = write_parquet(_rows(2, "aime24"), tmp_path / "aime24.parquet")
    gsm8k = write_parquet(_rows(2, "openai/gsm8k"), tmp_path / "gsm8k.parquet")
    cfg = compose_job("respo", ["algorithm=respo", f"data.train_files={train}", f"data.val_files=[{aime},{gsm8k}]"])
    check_data(cfg)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg.data.train_files = "~/train.parquet"
    check_data(cfg)


def test_a_plain_string_prompt_is_accepted_and_a_blank_one_refused(tmp_path, default_job):
    rows = _rows(4)
    for i, row in enumerate(rows):
        row["prompt"] = " \t " if i == 3 else f"What is {i} + 1?"
    path = tmp_path / "strings.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert _refusal(_with_files(default_job, path)) == f"{path}: row 3, column prompt: empty prompt"
    rows[3]["prompt"] = "What is 3 + 1?"
    pq.write_table(pa.Table.from_pylist(rows), path)
    check_data(_with_files(default_job, path))


def _set_prompt(value):
    return lambda row: row.update(prompt=value)


def _set_ground_truth(value):
    return lambda row: row["reward_model"].update(ground_truth=value)


@pytest.mark.parametrize(
    ("edit", "column", "what"),
    [
        (_set_prompt(None), "prompt", "empty prompt"),
        (_set_prompt([]), "prompt", "empty prompt"),
        (_set_prompt([{"content": " \n ", "role": "system"}, {"content": "\t", "role": "user"}]), "prompt", "empty"),
        (_set_prompt([{"content": None, "role": "user"}]), "prompt", "empty prompt"),
        (lambda row: row.update(reward_model=None), "reward_model", "reward_model is null"),
        (_set_ground_truth(None), "reward_model", "ground_truth is null (verl would score against the string 'None')"),
        (lambda row: row.update(data_source=None), "data_source", "data_source is null"),
    ],
    ids=["null prompt", "empty chat", "blank chat", "null content", "null reward_model", "null gt", "null source"],
)
def test_each_bad_row_is_named_by_file_row_and_column(tmp_path, default_job, edit, column, what):
    rows = _rows(6)
    for i in (2, 4):
        edit(rows[i])
    path = write_parquet(rows, tmp_path / "train.parquet")
    message = _refusal(_with_files(default_job, path))
    assert message.startswith(f"{path}: row 2, column {column}: ")
    assert what in message and message.endswith("(and 1 more row)")


def test_a_chat_with_one_non_blank_message_is_not_empty(tmp_path, default_job):
    rows = _rows(3)
    rows[1]["prompt"] = [{"content": " ", "role": "system"}, {"content": "What is 1 + 1?", "role": "user"}]
    check_data(_with_files(default_job, write_parquet(rows, tmp_path / "train.parquet")))


def test_every_kind_of_problem_in_the_file_is_on_the_one_line(tmp_path, default_job):
    rows = _rows(8)
    rows[1]["prompt"] = []
    for i in (3, 5, 6):
        rows[i]["reward_model"]["ground_truth"] = None
    rows[7]["data_source"] = UNKNOWN_SOURCE
    path = write_parquet(rows, tmp_path / "train.parquet")
    parts = _refusal(_with_files(default_job, path)).removeprefix(f"{path}: ").split("; ")
    assert [p.split(":")[0] for p in parts] == [
        "row 1, column prompt",
        "row 3, column reward_model",
        "row 7, column data_source",
    ]
    assert parts[1].endswith("(and 2 more rows)")


def test_a_ground_truth_field_missing_from_reward_model_is_refused(tmp_path, default_job):
    rows = _rows(3)
    for row in rows:
        row["reward_model"] = {"style": "rule"}
    path = tmp_path / "no_gt.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    message = _refusal(_with_files(default_job, path))
    assert message == f"{path}: row 0, column reward_model: reward_model has no ground_truth field (and 2 more rows)"


@pytest.mark.parametrize("column", ["prompt", "data_source", "reward_model"])
def test_a_file_without_a_needed_column_is_refused(tmp_path, default_job, column):
    path = tmp_path / "bare.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(), schema=VERL_SCHEMA).drop_columns([column]), path)
    assert _refusal(_with_files(default_job, path)).startswith(f"{path}: no column {column} ")


def test_a_missing_file_is_refused(tmp_path, default_job):
    train = write_parquet(_rows(), tmp_path / "train.parquet")
    missing = tmp_path / "nothere.parquet"
    assert _refusal(_with_files(default_job, train, [missing])) == f"{missing}: no such file"


def test_a_validation_file_is_checked_too(tmp_path, default_job):
    train = write_parquet(_rows(), tmp_path / "train.parquet")
    rows = _rows(3)
    rows[1]["reward_model"] = None
    val = write_parquet(rows, tmp_path / "val.parquet")
    message = _refusal(_with_files(default_job, train, [val]))
    assert message == f"{val}: row 1, column reward_model: reward_model is null"


def test_a_source_verls_default_scorer_does_not_know_is_refused(tmp_path, default_job):
    rows = _rows(6)
    for i in (3, 5):
        rows[i]["data_source"] = UNKNOWN_SOURCE
    path = write_parquet(rows, tmp_path / "train.parquet")
    message = _refusal(_with_files(default_job, path))
    assert message.startswith(f"{path}: row 3, column data_source: data_source '{UNKNOWN_SOURCE}' is not scored ")
    assert f"(NotImplementedError: Reward function is not implemented for data_source='{UNKNOWN_SOURCE}')" in message
    assert message.endswith("(and 1 more row)")


def test_the_cpu_kits_reward_accepts_its_source_and_refuses_a_foreign_one(tmp_path, cpu_job):
    kit = write_parquet(_rows(3, KIT_SOURCE), tmp_path / "kit.parquet")
    check_data(_with_files(cpu_job, kit, [kit]))
    foreign = write_parquet(_rows(3, "math_dapo"), tmp_path / "foreign.parquet")
    message = _refusal(_with_files(cpu_job, kit, [foreign]))
    assert message.startswith(f"{foreign}: row 0, column data_source: data_source 'math_dapo' is not scored ")
    assert "(ValueError: respo_verl.cpu.kit.reward scores only" in message and message.endswith("(and 2 more rows)")


CUSTOM_REWARD = """
import json


def compute_score(data_source, solution_str, ground_truth, extra_info=None, log=None, **kwargs):
    with open(log, "a") as f:
        f.write(json.dumps([data_source, solution_str, ground_truth, extra_info["index"]]) + "\\n")
    return 0.0
"""


def test_a_custom_reward_is_loaded_as_verl_loads_it_and_called_once_per_source(tmp_path, default_job):
    reward_file, log = tmp_path / "my_reward.py", tmp_path / "calls.jsonl"
    reward_file.write_text(CUSTOM_REWARD)
    rows = _rows(6)
    rows[0]["reward_model"]["ground_truth"] = None  # refused, and not the ground truth a probe gets
    for row in rows[3:]:
        row["data_source"] = "mine/b"
    train = write_parquet(rows, tmp_path / "train.parquet")
    val = write_parquet(_rows(2, "mine/b") + _rows(2, "mine/c"), tmp_path / "val.parquet")
    cfg = _with_files(default_job, val, [val, train])
    cfg.reward.custom_reward_function.path = str(reward_file)
    with open_dict(cfg):
        cfg.reward.custom_reward_function.reward_kwargs = {"log": str(log)}  # verl passes these to every call
    message = _refusal(cfg)
    assert message == f"{train}: row 0, column reward_model: reward_model.ground_truth is null " + (
        "(verl would score against the string 'None')"
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [["mine/b", "", "1", 0], ["mine/c", "", "1", 0], ["math_dapo", "", "2", 1]]


def test_a_custom_reward_that_cannot_be_loaded_is_named_by_its_key(tmp_path, default_job):
    cfg = _with_files(default_job, write_parquet(_rows(), tmp_path / "train.parquet"))
    cfg.reward.custom_reward_function.path = str(tmp_path / "absent.py")
    message = _refusal(cfg)
    assert message.startswith(f"reward.custom_reward_function.path={tmp_path / 'absent.py'}: cannot load it ")


def test_a_model_scored_job_does_not_probe_data_sources(tmp_path, default_job):
    cfg = _with_files(default_job, write_parquet(_rows(3, UNKNOWN_SOURCE), tmp_path / "train.parquet"))
    OmegaConf.update(cfg, "reward.reward_model.enable", True)
    check_data(cfg)


def test_a_dapo_math_sized_file_is_checked(tmp_path, default_job):
    rows = _rows(DAPO_ROWS)
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=VERL_SCHEMA), path, row_group_size=ROW_GROUP)
    check_data(_with_files(default_job, path, [path]))
    rows[DAPO_ROWS - 1]["prompt"] = [{"content": "", "role": "user"}]
    pq.write_table(pa.Table.from_pylist(rows, schema=VERL_SCHEMA), path, row_group_size=ROW_GROUP)
    assert _refusal(_with_files(default_job, path)) == f"{path}: row {DAPO_ROWS - 1}, column prompt: empty prompt"


def test_the_entry_point_refuses_bad_data_in_one_line_before_ray(tmp_path):
    from support.entry import run_entry

    rows = _rows(4)
    rows[1]["prompt"] = [{"content": "", "role": "user"}]
    path = write_parquet(rows, tmp_path / "train.parquet")
    proc = run_entry(["algorithm=respo", "+device=cpu", f"data.train_files={path}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"respo_verl.main_ppo: {path}: row 1, column prompt: empty prompt" in proc.stderr
    assert "Traceback" not in proc.stderr and "TaskRunner" not in proc.stdout + proc.stderr


# --- hostile and remote input (issue 55): one line each, never a traceback --------------------------------------------


@pytest.mark.parametrize("url", ["hdfs://nn/data/train.parquet", "s3://bucket/train.parquet", "gs://b/x.parquet"])
def test_a_remote_file_passes_and_is_said_to_be_unchecked(tmp_path, default_job, url):
    said = []
    local = write_parquet(_rows(), tmp_path / "val.parquet")
    assert check_data(_with_files(default_job, url, [local]), echo=said.append) == [url]
    assert said == [f"data check: {url} is remote, not checked (verl reads it once the workers are up)"]


def test_a_damaged_parquet_page_is_refused_in_one_line(tmp_path, default_job):
    path = write_parquet(_rows(50), tmp_path / "train.parquet")
    data = bytearray(path.read_bytes())
    data[8:200] = b"\xff" * 192  # the first data pages; the footer (the schema) stays readable
    path.write_bytes(bytes(data))
    message = _refusal(_with_files(default_job, path))
    assert message.startswith(f"{path}: not a readable parquet file (OSError: "), message


def test_a_list_typed_data_source_is_refused_by_its_type(tmp_path, default_job):
    rows = _rows(3)
    table = pa.Table.from_pylist(rows, schema=VERL_SCHEMA)
    table = table.set_column(
        table.schema.get_field_index("data_source"), "data_source", pa.array([[r["data_source"]] for r in rows])
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    message = _refusal(_with_files(default_job, path))
    assert message.startswith(f"{path}: column data_source is list<") and message.endswith(": string>, not a string")


def test_an_integer_prompt_column_is_refused_by_its_type(tmp_path, default_job):
    rows = _rows(3)
    table = pa.Table.from_pylist(rows, schema=VERL_SCHEMA)
    table = table.set_column(table.schema.get_field_index("prompt"), "prompt", pa.array([1, 2, 3]))
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    assert _refusal(_with_files(default_job, path)) == (
        f"{path}: column prompt is int64, not a string or a list of chat messages"
    )


def test_a_nan_ground_truth_is_refused_like_a_null_one(tmp_path, default_job):
    rows = _rows(4)
    for i, row in enumerate(rows):
        row["reward_model"] = {"ground_truth": float("nan") if i in (1, 3) else float(i), "style": "rule"}
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    message = _refusal(_with_files(default_job, path))  # verl's math_dapo scorer then refuses the float truths too
    assert message.startswith(
        f"{path}: row 1, column reward_model: reward_model.ground_truth is NaN (verl would score against 'nan') "
        "(and 1 more row); "
    ), message
