"""Command-line pieces shared by the sims and the bridge's scripts (SPEC 7: bad arguments exit 2 with
one line on stderr, never a traceback)."""

import argparse


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit status 2 (no usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_at_least(minimum, what):
    """An argparse type: an integer (``1e6`` accepted) that is at least ``minimum``."""
    def parse(text):
        try:
            value = float(text)
            if not value.is_integer():
                raise ValueError
            value = int(value)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{what} must be >= {minimum}, got {value}")
        return value
    return parse
