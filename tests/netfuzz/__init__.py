"""The network fuzzer: mutated real client sessions replayed against every listener of
a live server (both forms), while a well-behaved client of each protocol keeps doing
round trips and the server's memory is watched (docs/netfuzz.md).

``python -m tests.netfuzz --seconds 60 --form both`` runs it; ``record.py`` records
the seed sessions under ``sessions/``; inputs that crashed, hung or leaked a server
are kept under ``regressions/`` and replayed by ``test_netfuzz.py``.
"""
