from tests.mns.harness import account, server

__all__ = ["account", "server"]
