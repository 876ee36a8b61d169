"""The `ar` method: plain decoding, the reference every other method is measured and checked against."""
from __future__ import annotations

from functools import partial

from ..decoding.engine import generate
from .registry import Method, register

AR = register(Method("ar", lambda s: partial(generate, s.model, s.tokenizer), help="plain decoding (the reference)",
                    batches=True))
