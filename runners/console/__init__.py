"""`deferline console`: a live web page over the topics and consumer groups."""

from ._cli import console_command
from ._console import Console, ConsoleOptions

__all__ = ["Console", "ConsoleOptions", "console_command"]
