"""Every error class the engine raises, in one leaf module (it imports nothing).

The HTTP status the server maps each to is in its docstring; the server catches them from
``engine`` (engine/__init__), never from the module that raises them.
"""

from __future__ import annotations

# -- configuration and checkpoint (refused at start-up) -------------------------------------------------


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which field and why."""


class CheckpointError(ValueError):
    """The checkpoint folder cannot be served as it is; the message names the file and tensor."""


class QuantConfigError(ValueError):
    """The checkpoint's quantization_config is one we cannot serve."""


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape the model expects."""


class RopeConfigError(ValueError):
    """The checkpoint's rope settings are a kind this engine does not implement."""


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its fields is not supported."""


# -- requests ------------------------------------------------------------------------------------------


class RequestError(ValueError):
    """A request the engine refuses; the message is meant for the client (HTTP 400)."""


class ModelNotFoundError(RequestError):
    """The request names a model that is neither the base nor a loaded adapter (HTTP 404)."""


# -- adapters ------------------------------------------------------------------------------------------


class AdapterError(ValueError):
    """Invalid adapter; message names the adapter, the module and the limit. (HTTP 400)"""


class AdapterNotFoundError(AdapterError):
    """Path missing / no adapter files there (HTTP 404)."""


class AdapterPathForbiddenError(AdapterError):
    """An adapter path outside every --lora-root, or runtime loads without a root (HTTP 403)."""


class FileChangedError(AdapterError):
    """A file changed between its header and its data being read, or while the folder was read."""


class JSONLimitError(ValueError):
    """JSON that is not valid, or outside the bounds of the bounded parser (adapter_files.py)."""


class AdapterNotLoadedError(KeyError):
    """No adapter of that name is registered (HTTP 404)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "adapter not loaded"


# -- the running engine ------------------------------------------------------------------------------------


class EngineDeadError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot continue."""


class EngineCoreExitedError(EngineDeadError):
    """The engine-core process exited without reporting a failure (killed, crashed)."""


class OverloadedError(RuntimeError):
    """The server cannot take the request now: waiting queue full, shutting down (HTTP 503)."""


class EngineFailedError(OverloadedError):
    """The step loop failed; the engine serves nothing more (HTTP 503, /health unhealthy)."""
