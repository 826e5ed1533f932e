"""One target in this process: ``python -m tests.fuzz.worker TARGET [libFuzzer flags]``
fuzzes it under atheris; ``python -m tests.fuzz.worker TARGET --replay FILE...`` runs
it once per file, uninstrumented, and exits 0 only if every file passed.

Run by :mod:`tests.fuzz.runner` and ``tests/fuzz/test_fuzz.py``, always in a
subprocess: a finding may abort the process (kio's native decoder does on a huge
declared array), and libFuzzer exits on the first one.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from tests.fuzz.targets import TARGETS

OneInput = Callable[[bytes], None]

# Signatures (see :func:`signature`) of findings already reported in this run: the
# runner sets it when it restarts a target, so the restart looks for new ones.
IGNORE_ENV = "POLYMQ_FUZZ_IGNORE"


def signature(exc: BaseException) -> str:
    """What tells one finding from another: the exception's type and the innermost
    frame it was raised in (the same bug found through different bytes matches)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{Path(frames[-1].filename).name}:{frames[-1].name}" if frames else "?"
    return f"{type(exc).__name__}@{where}"


def _ignoring(one_input: OneInput, known: frozenset[str]) -> OneInput:
    def run(data: bytes) -> None:
        try:
            one_input(data)
        except Exception as exc:
            if signature(exc) not in known:
                print(f"finding signature: {signature(exc)}", file=sys.stderr, flush=True)
                raise

    return run


def _load(name: str) -> OneInput:
    module = importlib.import_module(f"tests.fuzz.targets.{name}")
    one_input: OneInput = module.one_input
    return one_input


def replay(name: str, files: list[Path]) -> int:
    one_input = _load(name)
    for path in files:
        print(f"replaying {path}", flush=True)
        one_input(path.read_bytes())  # an exception exits non-zero, with its traceback
    print(f"{len(files)} inputs passed", flush=True)
    return 0


def fuzz(name: str, flags: list[str]) -> int:
    import atheris  # only here: replaying needs no atheris

    with atheris.instrument_imports(include=list(TARGETS[name].instrument)):
        one_input = _load(name)
    one_input = _ignoring(one_input, frozenset(json.loads(os.environ.get(IGNORE_ENV, "[]"))))
    atheris.Setup([sys.argv[0], *flags], one_input)
    atheris.Fuzz()
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in TARGETS:
        print(f"usage: worker TARGET [--replay FILE... | FLAGS]; targets: {', '.join(TARGETS)}")
        return 2
    name, rest = argv[0], argv[1:]
    if rest[:1] == ["--replay"]:
        return replay(name, [Path(arg) for arg in rest[1:]])
    return fuzz(name, rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
