"""polymq's conformance suite: real clients of every protocol against any target
(polymq or a reference broker), judged by the specifications, reported as tables."""
