"""The embedded storage engine: commit log, queue indexes, cursors, metadata."""

from polymq.storage.engine.config import Durability, EngineConfig
from polymq.storage.engine.engine import Engine

__all__ = ["Durability", "Engine", "EngineConfig"]
