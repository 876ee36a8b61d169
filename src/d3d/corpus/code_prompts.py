"""Code prompts for distillation data (`d3d data --prompts code`), kept apart from training_mix.

The main mix holds few code requests (about a tenth of its tokens), and code-like examples are what
retrieval and the drafter use on code (results/NOTEBOOK.md, "Retrieval and token trees"). Two sources add more, neither
overlapping the main mix, its unconsumed tail, the ShareGPT held-out slice or any benchmark prompt:

- sharegpt-code: ShareGPT first turns that mention code, from the positions of the seeded shuffle that
  training_mix never reaches (it zips its sources and stops at the shortest) and before the held-out pool.
- python-stdlib: "complete this function" stubs (signature and docstring, the HumanEval wording) of the
  documented public functions and methods of a fixed list of pure-Python standard-library modules.
  They depend on the Python version: the committed data records which one built it.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import random
import sys
import textwrap
import warnings
from itertools import chain, zip_longest

from .prompts import _CODE_HINT, prompt_hash, taken_prompt_hashes, training_mix, unused_sharegpt

STDLIB_MODULES = tuple("""
abc argparse ast base64 bisect calendar colorsys configparser contextlib copy csv dataclasses datetime
decimal difflib dis email.utils enum filecmp fnmatch fractions ftplib functools getopt gettext glob gzip
hashlib heapq hmac html http.cookies imaplib inspect ipaddress json keyword linecache locale logging
mailbox mimetypes ntpath numbers operator optparse os pathlib pickle pkgutil platform plistlib poplib
posixpath pprint pstats quopri random re reprlib sched secrets selectors shlex shutil smtplib socket
socketserver statistics string subprocess sysconfig tarfile tempfile textwrap threading timeit tokenize
trace traceback types typing urllib.parse urllib.request uuid warnings wave weakref xml.dom.minidom zipfile
zipimport""".split())
MIN_DOC_CHARS = 40


def _stub(name: str, fn, cls: str | None) -> str | None:
    """`def name(signature):` and its docstring, inside `class cls:` for a method; None unless the
    signature and docstring show as valid Python (defaults such as `<implicit>` or addresses do not)."""
    doc = inspect.getdoc(fn) or ""
    try:
        sig = str(inspect.signature(fn))
    except (TypeError, ValueError):
        return None
    if len(doc) < MIN_DOC_CHARS or " at 0x" in sig or '"""' in doc:
        return None
    body = f'def {name}{sig}:\n{textwrap.indent(chr(34) * 3 + doc + chr(34) * 3, "    ")}\n'
    stub = f"class {cls}:\n{textwrap.indent(body, '    ')}" if cls else body
    try:
        ast.parse(stub)
    except SyntaxError:
        return None
    return stub


def stdlib_stubs() -> list[str]:
    """Stubs of STDLIB_MODULES' documented public functions and methods, in module and name order."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for modname in STDLIB_MODULES:
            mod = importlib.import_module(modname)
            for name, obj in sorted(vars(mod).items()):
                if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                    continue
                if inspect.isfunction(obj):
                    out.append(_stub(name, obj, None))
                elif inspect.isclass(obj):
                    out += [_stub(m, f, name) for m, f in sorted(vars(obj).items())
                            if not m.startswith("_") and inspect.isfunction(f)]
    return [s for s in out if s]


def stdlib_prompts() -> list[str]:
    """The stubs as user messages, worded as the HumanEval benchmark words its prompts."""
    return [f"Complete the following Python function.\n\n```python\n{s}```" for s in stdlib_stubs()]


def sharegpt_code_prompts(mix: list[tuple[str, int, str]], seed: int = 0) -> list[tuple[int, str]]:
    """(index in ShareGPT, first human turn) of code requests that `mix` (training_mix(seed)) never uses
    and that lie before the held-out pool of the same seeded shuffle."""
    return [(i, p) for i, p in unused_sharegpt(mix, seed) if _CODE_HINT.search(p)]


def code_mix(seed: int = 0) -> list[tuple[str, int, str]]:
    """(source, index in source, prompt) of both code sources, each shuffled with `seed` and interleaved;
    prompts equal (after normalisation) to a benchmark prompt, a training_mix prompt, a ShareGPT
    held-out prompt or an earlier one are dropped."""
    train = training_mix(seed)
    seen = taken_prompt_hashes(train, seed)
    share = [("sharegpt-code", i, p) for i, p in sharegpt_code_prompts(train, seed)]
    stdlib = [("python-stdlib", i, p) for i, p in enumerate(stdlib_prompts())]
    random.Random(seed).shuffle(stdlib)
    mix = []
    for item in chain.from_iterable(zip_longest(share, stdlib)):
        if item is None:
            continue
        src, i, p = item
        h = prompt_hash(p)
        if h not in seen:
            seen.add(h)
            mix.append((src, i, p))
    return mix


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))
