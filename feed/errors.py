"""Errors any stage may raise for the command line to report."""

__all__ = ["EXIT_USAGE", "UsageError"]

EXIT_USAGE = 2  # a bad flag or value (argparse's own code)


class UsageError(SystemExit):
    """A usage mistake found after parsing (a flag's value, flags that do not go
    together): ``tidefeed`` prints its message and exits 2, as for argparse's own."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_USAGE)
        self.message = message

    def __str__(self) -> str:
        return self.message
