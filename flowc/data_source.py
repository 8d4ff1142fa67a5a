"""Where a run's rows come from: ``--data SOURCE[:SPLIT]`` or ``--data SOURCE:SUBSET:SPLIT``.

SOURCE is a local file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``, ``.tsv``, ``.arrow``),
a local folder (data files that Hugging Face ``datasets`` reads, one split per file name
such as ``train.parquet``/``test.parquet``, or a ``Dataset.save_to_disk`` folder), or a
Hugging Face hub dataset id (``org/name``), read from the local caches (the hub cache's
snapshot, then the ``datasets`` cache) and downloaded only when the network allows.

SUBSET is a hub dataset's configuration (e.g. ``openai/gsm8k:main:train``). SPLIT is a
split name with an optional ``datasets`` slice: ``train``, ``test[:64]``,
``train[:10%]+train[-5%:]``. Without one, the training data reads ``train`` (or the only
split) and the held-out data ``test``, then ``validation`` (or the only split). A single
file is one split, ``train``; a slice of it keeps each row's own line number for errors.

A string that is an existing path is always a path, colons and all.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from flowc.errors import DataError

_SPEC = re.compile(
    r"^(?P<source>.+?)(?::(?P<subset>[\w.-]+))?(?::(?P<split>[\w.-]+(?:\[[^\]]*\])?(?:\+[\w.-]+(?:\[[^\]]*\])?)*))$"
)
_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
TEXT_FILES = (".jsonl", ".json")  # read by flowc itself, so that errors name the line
DATASETS_FILES = {".parquet": "parquet", ".csv": "csv", ".tsv": "csv", ".arrow": "arrow"}
TRAIN_SPLITS = ("train",)
HELD_OUT_SPLITS = ("test", "validation", "valid", "eval", "dev")


class DataSource(BaseModel):
    """A parsed ``--data``/``--eval-data`` value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str  # a file, a folder or a hub dataset id
    subset: str | None = None  # a hub dataset's configuration
    split: str | None = None  # a split name, with an optional slice (datasets' syntax)

    @classmethod
    def parse(cls, spec: str) -> DataSource:
        if Path(spec).expanduser().exists():
            return cls(source=spec)
        m = _SPEC.match(spec)
        if m is None:
            return cls(source=spec)
        return cls(source=m["source"], subset=m["subset"], split=m["split"])

    def __str__(self) -> str:
        return ":".join(x for x in (self.source, self.subset, self.split) if x)

    @property
    def path(self) -> Path | None:
        """The local file or folder, or None (a hub id)."""
        p = Path(self.source).expanduser()
        return p if p.exists() else None

    def absolute(self) -> DataSource:
        """A local path made absolute (so a resume from another folder reads the same data)."""
        p = self.path
        return self if p is None else self.model_copy(update={"source": str(p.resolve())})

    def instructions(self, splits: dict[str, int], *, held_out: bool) -> list[tuple[str, int, int]]:
        """(split, start, stop) row ranges to read, given each split's length; an unknown
        split is an error listing the ones there are."""
        from datasets import ReadInstruction

        spec = self.split or _default_split(list(splits), held_out=held_out, where=str(self))
        try:
            ri = ReadInstruction.from_spec(spec)
        except (ValueError, AssertionError) as e:
            raise DataError(
                f"{self}: {spec!r} is not a split: {e}", fix="write SPLIT or SPLIT[start:stop], e.g. train or test[:64]"
            ) from None
        names = [x.splitname for x in ri._relative_instructions]  # datasets has no public getter
        for name in names:
            if name not in splits:
                raise DataError(
                    f"{self}: no split {name!r} (its splits: {', '.join(splits)})",
                    fix=f"name one of them: --data {self.source}{':' + self.subset if self.subset else ''}:{next(iter(splits))}",
                )
        try:
            return [(a.splitname, a.from_, a.to) for a in ri.to_absolute(splits)]
        except (ValueError, AssertionError) as e:
            raise DataError(f"{self}: cannot read {spec!r}: {e}", fix="a slice is [start:stop] in rows or %") from None


def absolute_data(spec: str | None) -> str | None:
    """``--data`` as run.json records it: a local path made absolute, a hub id as given."""
    return None if spec is None else str(DataSource.parse(spec).absolute())


def data_file(spec: str | None) -> str | None:
    """The local file a ``--data`` value reads (to hash it), or None."""
    if spec is None:
        return None
    p = DataSource.parse(spec).path
    return str(p) if p is not None and p.is_file() else None


def _default_split(splits: list[str], *, held_out: bool, where: str) -> str:
    prefer = HELD_OUT_SPLITS if held_out else TRAIN_SPLITS
    for s in prefer:
        if s in splits:
            return s
    if len(splits) == 1:
        return splits[0]
    raise DataError(
        f"{where} has the splits {', '.join(splits)} and none is {' or '.join(repr(s) for s in prefer)}",
        fix=f"name one: {where}:{splits[0]}",
    )


# ----------------------------------------------------------------- reading
def read_splits(src: DataSource) -> tuple[DataSource, dict[str, Any]]:
    """Each split of ``src`` read through Hugging Face ``datasets``: a ``datasets.Dataset`` per
    split name (a file or folder of data files, a saved dataset, a hub dataset id); and ``src``
    as read (``ID:NAME`` names a subset when the dataset has one of that name)."""
    p = src.path
    if p is not None and p.is_file():
        builder = DATASETS_FILES.get(p.suffix.lower())
        if builder is None:
            raise DataError(
                f"data file {src.source} is not a format flowc reads ({p.suffix or 'no suffix'})",
                fix=f"give a {', '.join([*TEXT_FILES, *DATASETS_FILES])} file, a folder of them or a hub dataset id",
            )
        kw: dict[str, Any] = {}
        if builder == "csv":  # CSV holds text: "007" stays "007" for a reward to compare, not the int 7
            kw = {"features": _text_columns(p, sep := "\t" if p.suffix.lower() == ".tsv" else ","), "sep": sep}
            kw["keep_default_na"] = False
        return src, {"train": _load(src, builder, data_files=str(p), split="train", **kw)}
    if p is not None:
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            return src, _as_splits(_load_saved(src, p))
        src = _subset_of(src, str(p))
        return src, _as_splits(_load(src, str(p), name=src.subset))
    if not _ID.match(src.source) or Path(src.source).suffix.lower() in (*TEXT_FILES, *DATASETS_FILES):
        raise DataError(
            f"data {src.source} does not exist",
            fix="give a data file (.jsonl, .parquet, .csv, …), a folder of them, or a hub dataset id (org/name)",
        )
    return _hub(src)


def _subset_of(src: DataSource, path: str) -> DataSource:
    """``src`` with its subset checked against the dataset's (a folder's or a cached hub
    snapshot's); ``ID:NAME`` with NAME one of them names that subset, not a split."""
    import datasets

    try:
        names = datasets.get_dataset_config_names(path)
    except Exception:  # datasets finds none to list: it says so when it loads
        return src
    if len(names) < 2 and src.subset is None:
        return src
    if src.subset is None and src.split is not None and src.split in names:
        return src.model_copy(update={"subset": src.split, "split": None})
    if src.subset is None or src.subset not in names:
        what = f"has no subset {src.subset!r}" if src.subset else "has subsets"
        raise DataError(
            f"{src.source} {what} (its subsets: {', '.join(names)})",
            fix=f"name one: --data {src.source}:{names[0]}" + (f":{src.split}" if src.split else ""),
        )
    return src


def _text_columns(p: Path, sep: str) -> Any:
    """Every column of a CSV file as text (its header names them)."""
    import csv

    import datasets

    with p.open(newline="", encoding="utf-8", errors="replace") as f:
        names = next(csv.reader(f, delimiter=sep), [])
    return datasets.Features({n: datasets.Value("string") for n in names})


def _as_splits(d: Any) -> dict[str, Any]:
    from datasets import Dataset

    return {"train": d} if isinstance(d, Dataset) else dict(d)


def _load(src: DataSource, path: str, **kw: Any) -> Any:
    import datasets

    try:
        with _quiet():
            return datasets.load_dataset(path, **kw)
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"cannot read {src.source} with Hugging Face datasets: {type(e).__name__}: {_first_line(e)}",
            fix="check the file's format (one table; JSONL: one JSON object per line)",
        ) from None


def _load_saved(src: DataSource, p: Path) -> Any:
    import datasets

    try:
        return datasets.load_from_disk(str(p))
    except Exception as e:
        raise DataError(f"cannot read the saved dataset {src.source}: {type(e).__name__}: {_first_line(e)}") from None


def _hub(src: DataSource) -> tuple[DataSource, dict[str, Any]]:
    """A hub dataset: its snapshot in the hub cache, else ``datasets``' own cache, else (unless
    offline) downloaded. Not found anywhere: an error with the command that fetches it."""
    import datasets
    from huggingface_hub import snapshot_download

    from flowc.ir.hub import cache_dir, offline

    try:
        local = snapshot_download(src.source, repo_type="dataset", cache_dir=cache_dir(), local_files_only=True)
    except Exception:  # not in the hub cache
        local = None
    if local is not None:
        src = _subset_of(src, local)
        return src, _as_splits(_load(src, local, name=src.subset))
    errors = []
    for net in (False, True) if not offline() else (False,):  # datasets' own cache, then the hub
        try:
            with _quiet(), _datasets_offline(not net):
                return src, _as_splits(datasets.load_dataset(src.source, name=src.subset))
        except ValueError as e:  # found, but not this subset (configuration)
            raise DataError(
                f"hub dataset {src.source}: {_first_line(e)}", fix="name one of its subsets: --data ID:SUBSET:SPLIT"
            ) from None
        except Exception as e:
            errors.append(f"{type(e).__name__}: {_first_line(e)}")
    subset = f", {src.subset!r}" if src.subset else ""
    raise DataError(
        f"hub dataset {src.source} is not in the local caches"
        + (" and HF_HUB_OFFLINE is set" if offline() else " and cannot be downloaded")
        + f" ({errors[-1]})",
        fix=f"on a machine with network: hf download --repo-type dataset {src.source} (HF_HUB_CACHE), or "
        f'python -c "import datasets; datasets.load_dataset({src.source!r}{subset})"; or give a local file',
    )


@contextmanager
def _datasets_offline(on: bool):
    """``datasets`` reads HF_HUB_OFFLINE once, at import; a cache-only attempt sets its flag
    for one call (it then reads its own cache instead of asking the hub)."""
    import datasets.config as cfg

    before = cfg.HF_HUB_OFFLINE
    cfg.HF_HUB_OFFLINE = on or before
    try:
        yield
    finally:
        cfg.HF_HUB_OFFLINE = before


@contextmanager
def _quiet():
    """No progress bars or cache notices from ``datasets`` on the user's console."""
    import datasets

    bars = datasets.utils.logging.is_progress_bar_enabled()
    level = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]
