"""polymq storage: the abstract model, the storage API and its implementations."""

from storage.api import StorageAPI
from storage.errors import *  # noqa: F403
from storage.errors import __all__ as _errors_all
from storage.model import *  # noqa: F403
from storage.model import __all__ as _model_all

__all__ = ["StorageAPI", *_errors_all, *_model_all]
