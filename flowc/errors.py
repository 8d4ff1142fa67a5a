"""The one exception tree of flowc.

Every error a user can meet is a :class:`FlowcError`. Each carries three
things a person needs to act on it: *what* was wrong, *where* (a file and a
line when the error is in the user's own file), and *how to fix it*. The CLI
prints ``str(error)`` without a traceback.

This module is a leaf: it imports nothing of flowc (and nothing outside the
standard library), so every layer — ``flowc.ir`` included — may raise these.

Tree::

    FlowcError
    ├── FlowDefinitionError      the @flow function is wrong (found while tracing)
    │   ├── RoleUsageError       a role used in a way its type does not allow
    │   ├── ControlFlowError     Python if/for/while on a traced value
    │   ├── ValueUseError        a value used before it exists, or of the wrong kind
    │   ├── SignatureError       a parameter or keyword that is not accepted
    │   └── MissingUpdateError   a flow that never trains anything
    ├── LoadError                a FILE that cannot be read or holds no usable flow
    ├── SpecError                a model, cluster, workload or config that is invalid
    ├── IRError                  a malformed graph or plan document
    │   └── VerificationError    an IR invariant does not hold
    ├── PlanError                the planner cannot satisfy the request
    │   └── InfeasibleError      nothing fits; says what and by how much
    └── RuntimeFailure           execution failed (a worker died, a timeout, bad data)
        ├── WorkerError          a worker raised or died; names role and rank
        ├── WorkerTimeout        a remote call did not answer in time
        └── DataError            user data or a user function is unusable
"""

from __future__ import annotations

import linecache
import os
from dataclasses import dataclass


def display_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (how a
    user typed it), else unchanged."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


@dataclass(frozen=True)
class SourceLocation:
    """A place in a user's source file."""

    file: str
    line: int

    @property
    def code(self) -> str:
        """The text of the line, stripped (empty when the file is unreadable)."""
        return linecache.getline(self.file, self.line).strip()

    def __str__(self) -> str:
        return f"{display_path(self.file)}:{self.line}"


class FlowcError(Exception):
    """Base of every error flowc raises on purpose.

    Args:
        what: one sentence saying what was wrong.
        fix: what the user should do about it (optional but expected).
        where: the user's file and line, when known.
    """

    def __init__(self, what: str, *, fix: str | None = None, where: SourceLocation | None = None):
        self.what = what
        self.fix = fix
        self.where = where
        super().__init__(what)

    def with_location(self, where: SourceLocation | None) -> FlowcError:
        """Attach a location if none is set yet; returns self for chaining."""
        if self.where is None and where is not None:
            self.where = where
        return self

    def __str__(self) -> str:
        head = f"{self.where}: {self.what}" if self.where else self.what
        lines = [head]
        if self.where is not None and self.where.code:
            lines.append(f"    {self.where.code}")
        if self.fix:
            lines.append(f"  fix: {self.fix}")
        return "\n".join(lines)


class FlowDefinitionError(FlowcError):
    """The @flow function itself is wrong; found while tracing it."""


class RoleUsageError(FlowDefinitionError):
    """A role is used in a way its type does not allow (e.g. ``ref.update``)."""


class ControlFlowError(FlowDefinitionError):
    """Python control flow (if/for/while, bool(), len()) on a traced value."""


class ValueUseError(FlowDefinitionError):
    """A value used before it exists, or a value of the wrong kind passed on."""


class SignatureError(FlowDefinitionError):
    """A parameter or keyword argument that is not accepted."""


class MissingUpdateError(FlowDefinitionError):
    """A flow that never calls ``update`` on any role."""


class LoadError(FlowcError):
    """A FILE that cannot be loaded or holds no usable @flow."""


class SpecError(FlowcError):
    """An invalid model, cluster, workload or configuration value."""


class IRError(FlowcError):
    """A malformed IR graph or plan document."""


class VerificationError(IRError):
    """An IR invariant does not hold (raised by ``flowc.ir.verify``)."""


class PlanError(FlowcError):
    """The planner cannot satisfy the request."""


class InfeasibleError(PlanError):
    """No placement fits; the message names the role, phase and shortfall."""


class RuntimeFailure(FlowcError):
    """Execution failed."""


class WorkerError(RuntimeFailure):
    """A worker raised or died; the message names the role and rank."""


class WorkerTimeout(RuntimeFailure):
    """A remote call did not answer within its timeout."""


class Interrupted(RuntimeFailure):
    """A signal stopped the run; ``exit_code`` is 128 + the signal's number (130: SIGINT, 143: SIGTERM)."""

    def __init__(self, what: str, *, exit_code: int, fix: str | None = None) -> None:
        super().__init__(what, fix=fix)
        self.exit_code = exit_code


class DataError(RuntimeFailure):
    """User data or a user-supplied function is unusable."""


__all__ = [
    "ControlFlowError",
    "DataError",
    "FlowDefinitionError",
    "FlowcError",
    "IRError",
    "InfeasibleError",
    "LoadError",
    "MissingUpdateError",
    "PlanError",
    "RoleUsageError",
    "RuntimeFailure",
    "SignatureError",
    "SourceLocation",
    "SpecError",
    "ValueUseError",
    "VerificationError",
    "WorkerError",
    "WorkerTimeout",
]
