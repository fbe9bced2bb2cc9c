"""Errors that map to exit codes: BadInput -> 2 (the message names the file, tensor or site at fault)."""


class BadInput(Exception):
    """User-facing bad input or bad usage. The CLI prints the message alone and exits with code 2."""
