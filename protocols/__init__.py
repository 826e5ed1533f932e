"""polymq protocols (not built yet: see the open issues)."""
