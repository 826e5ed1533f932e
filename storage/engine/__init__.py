"""The embedded storage engine: commit log, queue indexes, cursors, metadata."""

from storage.engine.config import Durability, EngineConfig
from storage.engine.engine import Engine

__all__ = ["Durability", "Engine", "EngineConfig"]
