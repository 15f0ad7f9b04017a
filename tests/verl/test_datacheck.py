"""The data check before Ray: real parquet files in verl's schema, the real scorers (verl's default_compute_score and
the CPU kit's reward), the composed jobs, and the entry point's refusal as a user sees it."""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from respo_verl.data.common import make_row, write_parquet
from respo_verl.verl.compose import compose_job
from respo_verl.verl.datacheck import DataCheckError, check_data, check_file, scorer


def _rows(n=4, source="math_dapo"):
    return [make_row(f"What is {i} + 1?", str(i + 1), source, i, "train", "test") for i in range(n)]


def _job(train, val=None, cpu=False):
    if cpu:
        cfg = compose_job("respo", ["algorithm=respo", "+device=cpu"])
    else:
        cfg = OmegaConf.create({"reward": {"custom_reward_function": {"path": None, "name": None}}, "data": {}})
    cfg.data.train_files = str(train)
    cfg.data.val_files = [str(v) for v in (val or [])]
    return cfg


def test_good_files_pass_with_verls_default_scorer(tmp_path):
    train = write_parquet(_rows(), tmp_path / "train.parquet")
    val = write_parquet(_rows(2, "aime24"), tmp_path / "aime24.parquet")
    check_data(_job(train, [val]))


@pytest.mark.parametrize(
    ("edit", "column", "what"),
    [
        (lambda r: r.update(prompt=[]), "prompt", "empty prompt"),
        (lambda r: r.update(prompt=[{"content": " \n ", "role": "user"}]), "prompt", "empty prompt"),
        (lambda r: r.update(prompt=None), "prompt", "empty prompt"),
        (lambda r: r.update(reward_model=None), "reward_model", "reward_model is null"),
        (lambda r: r["reward_model"].update(ground_truth=None), "reward_model", "ground_truth is null"),
        (lambda r: r.update(data_source=None), "data_source", "data_source is empty or null"),
    ],
)
def test_each_bad_row_is_named_by_file_row_and_column(tmp_path, edit, column, what):
    rows = _rows(6)
    for i in (2, 4):
        edit(rows[i])
    path = write_parquet(rows, tmp_path / "train.parquet")
    with pytest.raises(DataCheckError) as err:
        check_data(_job(path))
    message = str(err.value)
    assert message.startswith(f"{path}: row 2, column {column}: ") and what in message
    assert message.endswith("(and 1 more rows)") and "\n" not in message


def test_a_missing_file_or_column_is_refused(tmp_path):
    with pytest.raises(DataCheckError, match=r"nothere.parquet: no such file"):
        check_data(_job(tmp_path / "nothere.parquet"))
    table = pa.Table.from_pylist(_rows()).drop_columns(["reward_model"])
    pq.write_table(table, tmp_path / "bare.parquet")
    with pytest.raises(DataCheckError, match=r"bare.parquet: no column\(s\) \['reward_model'\]"):
        check_data(_job(tmp_path / "bare.parquet"))


def test_a_validation_file_is_checked_too(tmp_path):
    train = write_parquet(_rows(), tmp_path / "train.parquet")
    rows = _rows(3)
    rows[1]["reward_model"] = None
    val = write_parquet(rows, tmp_path / "val.parquet")
    with pytest.raises(DataCheckError, match=r"val.parquet: row 1, column reward_model: reward_model is null$"):
        check_data(_job(train, [val]))


def test_a_source_verls_scorer_does_not_know_is_refused(tmp_path):
    rows = _rows(5)
    for row in rows[3:]:
        row["data_source"] = "amc23"  # verl 0.9.1's scorer knows no AMC source (docs/cluster.md, "Data")
    path = write_parquet(rows, tmp_path / "train.parquet")
    with pytest.raises(DataCheckError) as err:
        check_data(_job(path))
    message = str(err.value)
    assert message.startswith(f"{path}: row 3, column data_source: verl's default_compute_score does not score ")
    assert "data_source='amc23' (NotImplementedError" in message and message.endswith("(and 1 more rows)")


def test_the_cpu_kits_scorer_refuses_a_foreign_source_and_accepts_its_own(tmp_path):
    from respo_verl.cpu.kit.task import DATA_SOURCE

    good = write_parquet(_rows(3, DATA_SOURCE), tmp_path / "kit.parquet")
    check_data(_job(good, cpu=True))
    foreign = write_parquet(_rows(3, "math_dapo"), tmp_path / "foreign.parquet")
    with pytest.raises(DataCheckError, match=r"foreign.parquet: row 0, column data_source: pkg://respo_verl.cpu.kit"):
        check_data(_job(foreign, cpu=True))


def test_a_dapo_math_sized_file_is_checked(tmp_path):
    path = write_parquet(_rows(17_000), tmp_path / "dapo.parquet")
    score, name = scorer(_job(path))
    assert check_file(path, score, name) == 17_000


def test_the_entry_point_refuses_bad_data_in_one_line_before_ray(tmp_path):
    rows = _rows(4)
    rows[1]["prompt"] = [{"content": "", "role": "user"}]
    path = write_parquet(rows, tmp_path / "train.parquet")
    cmd = [sys.executable, "-m", "respo_verl.main_ppo", "algorithm=respo", "+device=cpu", f"data.train_files={path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"respo_verl.main_ppo: {path}: row 1, column prompt: empty prompt" in proc.stderr
    assert "ray" not in (proc.stdout + proc.stderr).lower().replace("array", "")
