"""deferline's processes: triggerer, scheduler, worker, Airflow bridge, console, demo."""

from ._transitions import IllegalTransition

__all__ = ["IllegalTransition"]
