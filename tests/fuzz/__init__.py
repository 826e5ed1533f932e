"""Coverage-guided fuzzing of every pure codec and parser (atheris over libFuzzer).

Each target (:mod:`tests.fuzz.targets`) feeds bytes to one codec and lets through only
that codec's documented errors; anything else is a finding. ``python -m tests.fuzz``
runs them (see ``docs/fuzzing.md``); ``tests/fuzz/test_fuzz.py`` replays the findings
and runs each target briefly in CI. Nothing here may import a codec at package import
time: the worker imports the target under atheris' instrumentation, which only covers
modules imported after it starts.
"""
