"""The ``flowc`` command line.

Every command prints a :class:`~flowc.errors.FlowcError` as ``file:line:
what`` plus a ``fix:`` line, without a traceback, and exits with status 1.
Set ``FLOWC_TRACEBACK=1`` to see the Python traceback as well.
"""

from __future__ import annotations

import json
import os
import sys
from enum import Enum
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from flowc._version import __version__
from flowc.errors import FlowcError

app = typer.Typer(
    name="flowc",
    help="flowc: write an RL algorithm as a @flow; trace it, plan it, run it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"flowc {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool | None, typer.Option("--version", "-V", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = None,
) -> None:
    """flowc: write an RL algorithm as a @flow; trace it, plan it, run it."""


class GraphFormat(str, Enum):
    text = "text"
    dot = "dot"
    mermaid = "mermaid"


FileArg = Annotated[str, typer.Argument(help="A Python file with one @fc.flow, or FILE:NAME to pick one.", metavar="FILE")]
OverridesArg = Annotated[
    list[str] | None, typer.Argument(help="Hyperparameter overrides, e.g. n=4 clip=0.28.", metavar="[NAME=VALUE]...")
]


@app.command()
def graph(
    file: FileArg,
    overrides: OverridesArg = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the graph as JSON (nodes and edges).")] = False,
    fmt: Annotated[GraphFormat, typer.Option("--format", "-f", help="Output format when not --json.")] = GraphFormat.text,
) -> None:
    """Trace the flow in FILE and print its dataflow graph."""
    from flowc.ir.serialize import to_dict
    from flowc.ir.text import format_graph, to_dot, to_mermaid
    from flowc.ir.verify import verify
    from flowc.loader import load_flow

    fl = load_flow(file)
    g = fl.trace(**fl.parse_overrides(overrides or []))
    verify(g)
    if as_json:
        typer.echo(json.dumps(to_dict(g), indent=2))
    elif fmt is GraphFormat.dot:
        typer.echo(to_dot(g), nl=False)
    elif fmt is GraphFormat.mermaid:
        typer.echo(to_mermaid(g), nl=False)
    else:
        typer.echo(format_graph(g), nl=False)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``flowc`` script."""
    try:
        app(args=argv, standalone_mode=True)
    except FlowcError as e:
        if os.environ.get("FLOWC_TRACEBACK"):
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", markup=True, highlight=False)
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
