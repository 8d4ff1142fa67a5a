"""The live progress bar of ``flowc run``."""

from __future__ import annotations

from typing import Any


class Progress:
    """A live bar: step, reward, accuracy, tokens/s, ETA."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        self.enabled = enabled
        self.total = total
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.p = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self.task = self.p.add_task("run", total=total, completed=done, info="")

    def __enter__(self) -> Progress:
        if self.enabled:
            self.p.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self.p.__exit__(*exc)

    def update(self, m: dict[str, Any]) -> None:
        if not self.enabled:
            return
        parts = []
        if "reward" in m:
            parts.append(f"reward {m['reward']:.3f}")
        if "accuracy" in m:
            parts.append(f"acc {m['accuracy']:.3f}")
        if "eval/accuracy" in m:
            parts.append(f"eval acc {m['eval/accuracy']:.3f}")
        if "eval/dpo_accuracy" in m:
            parts.append(f"eval pref acc {m['eval/dpo_accuracy']:.3f}")
        parts.append(f"{m['tokens_per_s']:.0f} tok/s")
        self.p.update(self.task, completed=m["step"], info=" · ".join(parts))
