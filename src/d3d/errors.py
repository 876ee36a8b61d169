"""The one exception users see (kept free of heavy imports so the CLI can fail fast)."""


class D3DError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero."""


def first_line(e: BaseException) -> str:
    """An exception's message on one line, for a D3DError: its first line, joined with the next while a line
    ends with ":" (torch's "Error(s) in loading state_dict for X:" says what only on the next); its type's
    name if it has no message."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    text = lines[0]
    for line in lines[1:]:
        if not text.endswith(":"):
            break
        text += " " + line
    return text
