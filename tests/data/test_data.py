"""The data scripts write exactly the schema verl's RLHFDataset reads, with the prompts the authors' preprocessing
builds, from local inputs in the published datasets' schemas (no network here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from respo_verl.data.common import AIME_SUFFIX, PROMPT_SUFFIX, VERL_SCHEMA

DATASETS = {"prepare_dapo_math.py": "dapo-math", "prepare_eval_math.py": "eval-math"}

DAPO_WRAPPED = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{p}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def _command(script: str, *args: str) -> list[str]:
    """``respo-verl prepare-data <dataset> ...`` as a subprocess, through the console script's module."""
    return [sys.executable, "-m", "respo_verl.cli", "prepare-data", DATASETS[script], *args]


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(script, *args), capture_output=True, text=True, timeout=120)


@pytest.fixture
def processed_dapo(tmp_path) -> Path:
    # open-r1/DAPO-Math-17k-Processed columns: prompt (str), solution, data_source, source_prompt, ability,
    # reward_model, extra_info.
    rows = [
        {
            "prompt": DAPO_WRAPPED.format(p="What is $1+1$?"),
            "solution": "2",
            "data_source": "math_dapo",
            "source_prompt": [{"content": DAPO_WRAPPED.format(p="What is $1+1$?"), "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": "a"},
        },
        {
            "prompt": "Find $x$ if $2x = 6$.",
            "solution": "3",
            "data_source": "math_dapo",
            "source_prompt": [{"content": "Find $x$ if $2x = 6$.", "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": "3", "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": "b"},
        },
    ]
    path = tmp_path / "dapo_processed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _read_with_verl(path: Path, tmp_path: Path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    config = OmegaConf.create({"filter_overlong_prompts": False, "cache_dir": str(tmp_path / "cache")})
    return RLHFDataset(str(path), tokenizer=None, config=config)


def test_dapo_math_schema_suffix_and_verl_reads_it(processed_dapo, tmp_path):
    out = tmp_path / "train.parquet"
    res = _run("prepare_dapo_math.py", "--source", str(processed_dapo), "--output", str(out))
    assert res.returncode == 0, res.stderr
    table = pq.read_table(out)
    assert table.schema.equals(VERL_SCHEMA)
    rows = table.to_pylist()
    assert [r["prompt"][0]["content"] for r in rows] == [
        f"What is $1+1$? {PROMPT_SUFFIX}",
        f"Find $x$ if $2x = 6$. {PROMPT_SUFFIX}",
    ]
    assert all(r["data_source"] == "math_dapo" and r["prompt"][0]["role"] == "user" for r in rows)
    assert [r["reward_model"] for r in rows] == [
        {"ground_truth": "2", "style": "rule"},
        {"ground_truth": "3", "style": "rule"},
    ]
    dataset = _read_with_verl(out, tmp_path)
    assert len(dataset) == 2
    item = dataset[1]
    assert item["raw_prompt"] == [{"content": f"Find $x$ if $2x = 6$. {PROMPT_SUFFIX}", "role": "user"}]
    assert item["reward_model"]["ground_truth"] == "3" and item["index"] == 1


def test_dapo_original_chat_schema_is_accepted(tmp_path):
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": DAPO_WRAPPED.format(p="Compute $3^2$."), "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": "9", "style": "rule"},
            "extra_info": {"index": "0"},
        }
    ]
    src = tmp_path / "orig.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "o.parquet"
    assert _run("prepare_dapo_math.py", "--source", str(src), "--output", str(out)).returncode == 0
    row = pq.read_table(out).to_pylist()[0]
    assert row["prompt"][0]["content"] == f"Compute $3^2$. {PROMPT_SUFFIX}"
    assert row["reward_model"]["ground_truth"] == "9"


# One DAPO-Math-17k row as published, and the prompt the authors' preprocessing makes of it, written out by hand:
# the template's first paragraph deleted, its closing line replaced by one space and the instruction.
OFFICIAL_EXAMPLE_IN = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "Let $f(x) = x^2$.  Find $f(3)$ .\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
OFFICIAL_EXAMPLE_OUT = (
    "Let $f(x) = x^2$.  Find $f(3)$ . Please reason step by step, and put your final answer within \\boxed{}."
)


def test_prompt_matches_the_official_format_byte_for_byte(tmp_path):
    row = {
        "data_source": "math_dapo",
        "prompt": [{"content": OFFICIAL_EXAMPLE_IN, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "9", "style": "rule"},
        "extra_info": {"index": "x"},
    }
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps(row))
    out = tmp_path / "one.parquet"
    assert _run("prepare_dapo_math.py", "--source", str(src), "--output", str(out)).returncode == 0
    content = pq.read_table(out).to_pylist()[0]["prompt"][0]["content"]
    assert content.encode() == OFFICIAL_EXAMPLE_OUT.encode()


def test_chinese_language_problems_are_kept(tmp_path):
    # The authors train on every DAPO-Math-17k problem, Chinese ones included (the processed `all` configuration).
    problem = "已知 $x+1=3$，求 $x$。"
    rows = [{"prompt": DAPO_WRAPPED.format(p=problem), "solution": "2", "data_source": "math_dapo"}]
    src = tmp_path / "cn.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp_path / "cn_out.parquet"
    assert _run("prepare_dapo_math.py", "--source", str(src), "--output", str(out)).returncode == 0
    written = pq.read_table(out).to_pylist()
    assert [r["prompt"][0]["content"] for r in written] == [f"{problem} {PROMPT_SUFFIX}"]
    from respo_verl.data import dapo_math

    assert dapo_math.DEFAULT_CONFIG == "all"


def test_eval_benchmarks(tmp_path):
    aime = tmp_path / "aime.jsonl"
    aime.write_text(json.dumps({"id": 60, "problem": "Find the remainder.", "answer": "204", "year": 2024}) + "\n")
    amc = tmp_path / "amc.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": 0, "question": "How many?", "answer": 27.0}]), amc)
    for bench, src in (("aime24", aime), ("amc23", amc)):
        res = _run("prepare_eval_math.py", "--benchmark", bench, "--source", str(src), "--output-dir", str(tmp_path))
        assert res.returncode == 0, res.stderr
    a, m = (pq.read_table(tmp_path / f"{b}.parquet") for b in ("aime24", "amc23"))
    assert a.schema.equals(VERL_SCHEMA) and m.schema.equals(VERL_SCHEMA)
    assert a.to_pylist()[0]["data_source"] == "aime24"
    # the authors' instructions: AIME gets "Let's think step by step ...", AMC23 the training suffix
    assert a.to_pylist()[0]["prompt"][0]["content"] == f"Find the remainder. {AIME_SUFFIX}"
    assert m.to_pylist()[0]["prompt"][0]["content"] == f"How many? {PROMPT_SUFFIX}"
    amc_row = m.to_pylist()[0]
    assert amc_row["reward_model"]["ground_truth"] == "27"  # 27.0 from the float column
    assert amc_row["data_source"] == "math_dapo" and amc_row["extra_info"]["source"] == "amc23"
    assert _read_with_verl(tmp_path / "aime24.parquet", tmp_path)[0]["data_source"] == "aime24"


def test_verl_scores_the_written_rows_with_the_dapo_verifier(tmp_path, processed_dapo):
    from verl.utils.reward_score import default_compute_score

    out = tmp_path / "t.parquet"
    assert _run("prepare_dapo_math.py", "--source", str(processed_dapo), "--output", str(out)).returncode == 0
    row = pq.read_table(out).to_pylist()[0]
    right = default_compute_score(
        row["data_source"], "so the answer is \\boxed{2}", row["reward_model"]["ground_truth"]
    )
    wrong = default_compute_score(
        row["data_source"], "so the answer is \\boxed{5}", row["reward_model"]["ground_truth"]
    )
    assert (right["score"], wrong["score"]) == (1.0, -1.0)


@pytest.mark.parametrize(
    "script, args, message",
    [
        (
            "prepare_dapo_math.py",
            ["--source", "/nonexistent/x.parquet", "--output", "o.parquet"],
            "input file not found",
        ),
        (
            "prepare_eval_math.py",
            ["--benchmark", "aime24", "--source", "{bad}", "--output-dir", "."],
            "no problem column",
        ),
    ],
)
def test_bad_input_fails_clearly(tmp_path, script, args, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no problem column", "answer": "1"}))
    args = [a.replace("{bad}", str(bad)) for a in args]
    res = subprocess.run(_command(script, *args), capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
