"""The `batchrun` command group: a JobError, a bad flag or a path the filesystem refuses ends
a command with one line on stderr."""

from __future__ import annotations

from typing import Any

import click

from batchrun.errors import JobError


class Group(click.Group):
    """Reports a JobError, a bad flag or a path the filesystem refuses as one line on stderr and
    exit code 2, without a traceback or a usage block."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except JobError as exc:
            _fail(ctx, str(exc) or type(exc).__name__)
        except click.UsageError as exc:
            command = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            _fail(ctx, f"{exc.format_message()} (see '{command} --help')")
        except OSError as exc:  # a path the filesystem refuses (too long, a loop, no access)
            where = f": {str(exc.filename)[:200]!r}" if exc.filename is not None else ""
            _fail(ctx, f"{exc.strerror or type(exc).__name__}{where}")


def _fail(ctx: click.Context, message: str) -> None:
    click.echo(f"batchrun: error: {' '.join(message.split())}", err=True)
    ctx.exit(2)
