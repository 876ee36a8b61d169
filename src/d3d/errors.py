"""The one exception users see (kept free of heavy imports so the CLI can fail fast)."""


class D3DError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero."""
