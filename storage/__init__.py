"""polymq storage: the abstract model, the storage API and its implementations."""

from polymq.storage.api import StorageAPI
from polymq.storage.errors import *  # noqa: F403
from polymq.storage.errors import __all__ as _errors_all
from polymq.storage.model import *  # noqa: F403
from polymq.storage.model import __all__ as _model_all

__all__ = ["StorageAPI", *_errors_all, *_model_all]
