"""polymq nameserver (not built yet: see the open issues)."""
