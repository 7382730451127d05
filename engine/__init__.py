"""The trigger engine."""
X: int = 1
