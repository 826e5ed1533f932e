"""polymq navigation (not built yet: see the open issues)."""
