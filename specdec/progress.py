"""The one progress-bar look of the project (rich, on stderr): a description, a bar, done/total,
elapsed and remaining time."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress


def progress_bar(enabled: bool, transient: bool = False) -> Progress:
    """A rich Progress on stderr; `enabled` False gives a disabled one (no output), `transient`
    removes the bar when it stops. rich is imported here, on first use (light CLI start-up)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=transient,
        disable=not enabled,
    )
