"""Settings read from environment variables that refuse a variable naming no setting.

pydantic-settings ignores ``<PREFIX>_<NAME>`` when ``NAME`` is no field, so a misspelt
variable (``CHUNKCACHE_SERVE_APIKEY``) silently leaves its setting at the default.
:class:`CheckedEnvSettings` raises :class:`UsageError` for it instead.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from pydantic_settings import BaseSettings

from chunkcache.core.errors import UsageError


class CheckedEnvSettings(BaseSettings):
    """Base of settings whose ``model_config`` sets an ``env_prefix``: building one raises
    :class:`UsageError` for any environment variable with that prefix that names no field
    (in any case, as pydantic-settings reads fields) nor, spelt exactly, one of
    ``other_env_names``."""

    other_env_names: ClassVar[tuple[str, ...]] = ()  # read by the class itself, e.g. a file's

    def __init__(self, **values: Any) -> None:
        """``values`` over the environment over the defaults; :class:`UsageError` for an
        environment variable with this class's prefix that names no setting."""
        prefix = type(self).model_config["env_prefix"].upper()
        fields = [prefix + field.upper() for field in type(self).model_fields]
        known = [*fields, *self.other_env_names]
        unknown = sorted(
            name
            for name in os.environ
            if name.upper().startswith(prefix)
            and name.upper() not in fields
            and name not in self.other_env_names
        )
        if unknown:
            raise UsageError(f"unknown setting {', '.join(unknown)}; known: {', '.join(known)}")
        super().__init__(**values)
