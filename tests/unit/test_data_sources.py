"""``--data`` reads what Hugging Face ``datasets`` reads: files of every format, folders with
splits, hub dataset ids from the local cache; a subset and a split (with a slice) may be named,
and every row keeps a number an error can name."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from helpers import EXAMPLES

from flowc.data_source import DataSource, absolute_data, data_file
from flowc.errors import DataError
from flowc.inputs import load_rows

ROWS = [{"prompt": f"{i}+1=", "answer": f"{i + 1:02d}"} for i in range(6)]  # "01": text, not a number


def write_jsonl(p: Path, rows: list[dict]) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_a_spec_names_a_source_a_subset_and_a_split(tmp_path):
    assert DataSource.parse("d.parquet") == DataSource(source="d.parquet")
    assert DataSource.parse("d.parquet:test") == DataSource(source="d.parquet", split="test")
    assert DataSource.parse("openai/gsm8k:main:train[:10%]") == DataSource(
        source="openai/gsm8k", subset="main", split="train[:10%]"
    )
    assert DataSource.parse("data/:train[:4]+test[-1:]").split == "train[:4]+test[-1:]"
    odd = tmp_path / "a:b.jsonl"  # an existing path is a path, colon and all
    write_jsonl(odd, ROWS)
    assert DataSource.parse(str(odd)) == DataSource(source=str(odd))
    assert str(DataSource.parse("openai/gsm8k:main:test")) == "openai/gsm8k:main:test"
    # run.json: a local path absolute with its split kept, a hub id as given; the file is hashed
    assert absolute_data("examples/../examples/data/arith_trl.jsonl:train[:3]").endswith(
        "/examples/data/arith_trl.jsonl:train[:3]"
    )
    assert absolute_data("openai/gsm8k:main:train") == "openai/gsm8k:main:train"
    assert data_file(str(EXAMPLES / "data/arith_trl.jsonl:train[:3]")) == str(EXAMPLES / "data/arith_trl.jsonl")
    assert data_file("openai/gsm8k:main") is None


def test_every_format_datasets_reads_loads_with_nested_columns_intact(tmp_path):
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "d.parquet")
    pcsv.write_csv(table, tmp_path / "d.csv")
    (tmp_path / "d.tsv").write_text("prompt\tanswer\n" + "".join(f"{r['prompt']}\t{r['answer']}\n" for r in ROWS))
    with pa.ipc.new_stream(tmp_path / "d.arrow", table.schema) as w:
        w.write_table(table)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))  # a JSON array of rows
    for name in ("d.parquet", "d.csv", "d.tsv", "d.arrow", "d.json"):
        d = load_rows(str(tmp_path / name))
        assert d.rows == ROWS, name
        assert d.where(2) == f"{tmp_path / name}:3"
    verl = load_rows(str(EXAMPLES / "data/arith_verl.parquet"))
    row = verl.rows[0]
    assert row["prompt"] == [{"role": "user", "content": "21+57="}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "78"} and row["extra_info"]["index"] == 0
    with pytest.raises(DataError, match=r"d\.txt is not a format flowc reads"):
        (tmp_path / "d.txt").write_text("1+1=\n")
        load_rows(str(tmp_path / "d.txt"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"cannot read .*bad\.parquet with Hugging Face datasets"):
        load_rows(str(tmp_path / "bad.parquet"))


def test_a_split_slice_of_a_jsonl_file_keeps_each_rows_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in ROWS[:3]) + "\n\n" + "\n".join(json.dumps(r) for r in ROWS[3:]) + "\n")
    d = load_rows(f"{p}:train[-2:]")
    assert d.rows == ROWS[-2:] and d.lines == [6, 7]
    assert load_rows(f"{p}:train[:50%]").rows == ROWS[:3]
    with pytest.raises(DataError, match=r"no split 'test' \(its splits: train\)") as e:
        load_rows(f"{p}:test")
    assert "--data" in e.value.fix and ":train" in e.value.fix


def test_a_folder_has_splits_and_held_out_data_defaults_to_test(tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", ROWS[:4])
    write_jsonl(tmp_path / "d" / "test.jsonl", ROWS[4:])
    assert load_rows(str(tmp_path / "d")).rows == ROWS[:4]
    held = load_rows(str(tmp_path / "d"), held_out=True)
    assert held.rows == ROWS[4:] and held.where(1) == f"{tmp_path / 'd'} (test):2"
    assert load_rows(f"{tmp_path / 'd'}:train[1:3]").rows == ROWS[1:3]
    with pytest.raises(DataError, match=r"no split 'valid' \(its splits: (train, test|test, train)\)"):
        load_rows(f"{tmp_path / 'd'}:valid")
    write_jsonl(tmp_path / "e" / "a.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "e" / "b.jsonl", ROWS[2:])  # no split names: one split, 'train'
    assert load_rows(str(tmp_path / "e"), held_out=True).rows == ROWS


def test_a_saved_dataset_folder_loads(tmp_path):
    import datasets

    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:5]), "validation": datasets.Dataset.from_list(ROWS[5:])}
    ).save_to_disk(str(tmp_path / "saved"))
    assert load_rows(str(tmp_path / "saved")).rows == ROWS[:5]
    assert load_rows(str(tmp_path / "saved"), held_out=True).rows == ROWS[5:]


def _cached_hub_dataset(cache: Path, repo: str) -> None:
    """``repo`` as ``hf download --repo-type dataset`` leaves it in the hub cache: two subsets."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"datasets--{repo.replace('/', '--')}"
    snap = root / "snapshots" / sha
    write_jsonl(snap / "main" / "train.jsonl", ROWS[:4])
    write_jsonl(snap / "main" / "test.jsonl", ROWS[4:])
    write_jsonl(snap / "hard" / "train.jsonl", ROWS[::-1])
    configs = "".join(
        f"- config_name: {c}\n  data_files:\n" + "".join(f"  - split: {s}\n    path: {c}/{s}.jsonl\n" for s in splits)
        for c, splits in (("main", ("train", "test")), ("hard", ("train",)))
    )
    (snap / "README.md").write_text(f"---\nconfigs:\n{configs}---\n# arithmetic\n")
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)


def test_a_hub_dataset_id_reads_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _cached_hub_dataset(tmp_path / "hub", "someorg/arith")
    assert load_rows("someorg/arith:main:train").rows == ROWS[:4]
    held = load_rows("someorg/arith:main", held_out=True)
    assert held.rows == ROWS[4:] and held.where(0) == "someorg/arith (main/test):1"
    assert load_rows("someorg/arith:hard:train[:2]").rows == ROWS[::-1][:2]


def test_a_hub_dataset_that_is_not_cached_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never waits for the network
    with pytest.raises(DataError, match=r"hub dataset nobody-here/none is not in the local caches and HF_HUB_OFFLINE") as e:
        load_rows("nobody-here/none:train")
    assert "hf download --repo-type dataset nobody-here/none" in e.value.fix


def test_a_missing_file_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"data data/train\.jsonl does not exist"):
        load_rows("data/train.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        load_rows(str(tmp_path / "nope.parquet:test"))


def test_a_hub_dataset_with_subsets_needs_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _cached_hub_dataset(tmp_path / "hub", "someorg/arith")
    with pytest.raises(DataError, match=r"someorg/arith has subsets \(its subsets: (main, hard|hard, main)\)") as e:
        load_rows("someorg/arith")
    assert "--data someorg/arith:" in e.value.fix
    with pytest.raises(DataError, match=r"someorg/arith has no subset 'easy'"):
        load_rows("someorg/arith:easy:train")
