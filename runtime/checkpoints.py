"""A run's checkpoint folder: ``checkpoints/step-NNNNNN/`` folders, a ``latest`` pointer, and how
one is written atomically, found, verified and pruned. What goes into a checkpoint (each rank's
state, see :mod:`flowc.runtime.checkpoint_io`) is the controller's business; this module owns
the folder."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowc.errors import DataError, WorkerError
from flowc.runtime.checkpoint_io import verify_manifest, write_manifest

CONTROLLER_STATE = "controller.json"


class CheckpointDir:
    """``run_dir/checkpoints``, keeping the last ``keep`` checkpoints."""

    def __init__(self, run_dir: Path, keep: int = 1) -> None:
        self.run_dir, self.root, self.keep = run_dir, run_dir / "checkpoints", keep

    def clean(self) -> list[Path]:
        """Remove what an interrupted save left behind (temporary folders and files); returns them."""
        left = [*self.root.glob(".tmp-*"), *self.root.glob(".latest.tmp")] if self.root.exists() else []
        for p in left:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return left

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` points to, or None before the first."""
        pointer = self.root / "latest"
        return self.root / pointer.read_text().strip() if pointer.exists() else None

    def write(self, step: int, state: dict[str, Any], save_ranks: Callable[[Path], None]) -> Path:
        """Write step's checkpoint atomically: ``save_ranks(folder)`` writes the ranks' files, then
        the controller's state and a manifest of every file's sha256 go beside them in a temporary
        folder, which is renamed; ``latest`` then moves, and old checkpoints beyond ``keep`` go.
        A failure removes the half-written folder and leaves ``latest`` as it was."""
        tmp = self.root / f".tmp-{step:06d}-{os.getpid()}"
        final = self.root / f"step-{step:06d}"
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            tmp.mkdir(parents=True)
            save_ranks(tmp)
            (tmp / CONTROLLER_STATE).write_text(json.dumps(state))
            write_manifest(tmp, sorted(p.name for p in tmp.iterdir() if p.is_file()))
        except (OSError, WorkerError) as err:
            shutil.rmtree(tmp, ignore_errors=True)
            why = err.what if isinstance(err, WorkerError) else f"{type(err).__name__}: {err}"
            raise DataError(
                f"writing the checkpoint of step {step} in {self.root} failed ({why}); it was removed",
                fix="free space there (or keep fewer checkpoints: keep_checkpoints in the run config)",
            ) from err
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        (self.root / ".latest.tmp").write_text(final.name)
        os.replace(self.root / ".latest.tmp", self.root / "latest")
        kept = sorted(p for p in self.root.glob("step-*") if p.is_dir())
        for old in kept[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def read_latest(self) -> tuple[Path, dict[str, Any]]:
        """The latest checkpoint, its files verified against its manifest, and the controller's state."""
        ckpt = self.latest()
        if ckpt is None:
            raise DataError(f"{self.run_dir} has no checkpoint to resume from", fix="resume a run directory written by flowc run")
        if (ckpt / "manifest.json").exists() or not any(ckpt.glob("*.pt")):
            verify_manifest(ckpt)  # every file whole, as written (an older flowc's .pt checkpoints have none)
        try:
            return ckpt, json.loads((ckpt / CONTROLLER_STATE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"{ckpt}/{CONTROLLER_STATE} is unreadable: {e}", fix="resume from an earlier checkpoint") from None


__all__ = ["CheckpointDir"]
