"""polymq conformance (not built yet: see the open issues)."""
