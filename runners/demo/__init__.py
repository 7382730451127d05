"""The end-to-end demo: every process on the embedded broker, with a live view."""

from ._cli import demo_command
from ._plan import DemoOptions
from ._run import run_demo
from ._summary import DemoSummary

__all__ = [
    "DemoOptions",
    "DemoSummary",
    "demo_command",
    "run_demo",
]
