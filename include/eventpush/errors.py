"""Errors and their one-line texts shared by every layer (a leaf: imports nothing of eventpush)."""


class CatalogError(ValueError):
    """A refused catalog change, said in one line."""


def first_line(exc: BaseException) -> str:
    """The first line of an error's text, or its type's name when it has none: what a log
    line or a one-line message shows of it."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
