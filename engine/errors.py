"""Typed errors raised by the engine. Operator commands and bad input raise these;
callers (the service, the CLI) turn them into messages a user can act on."""


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """The model folder is missing, incomplete, or holds a model the engine cannot run."""


class UnknownRequestError(EngineError, KeyError):
    """No live request has this id."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown request"


class InvalidStateError(EngineError):
    """The request exists but is in a state where the command makes no sense."""


class NotEnoughBlocksError(EngineError):
    """The GPU or CPU pool has too few free blocks for the command."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is malformed (empty prompt, too long, duplicate id...)."""


class MalformedMessage(InvalidRequestError):
    """A message off a socket that is not of its protocol (engine/wire.py): no msgpack, a
    field of the wrong type, one missing or extra, an unknown kind, or over the size
    limit. Refused before anything acts on it."""


class PrefixNotCachedError(EngineError):
    """A pin/unpin named a prefix that has no cached block."""


class CommandExpired(EngineError):
    """A command reached the engine after its caller's deadline: it was not applied."""


class MigrationFailed(InvalidStateError):
    """The destination cannot take a moving request now (nothing changed there; it runs
    on where it was)."""


class MigrationRefused(MigrationFailed):
    """A destination refused a move that the service did not sign for it (no ticket, a
    forged, expired or used one) or whose messages are not the move's own."""


def error_from_wire(name: str, message: str) -> EngineError:
    """The error a core process reported as [type name, message], raised again on the
    caller's side (an unknown name becomes a plain EngineError naming it)."""
    cls = _BY_NAME.get(name)
    return cls(message) if cls is not None else EngineError(f"{name}: {message}")


_BY_NAME: dict[str, type[EngineError]] = {
    cls.__name__: cls for cls in (UnknownRequestError, InvalidStateError, NotEnoughBlocksError,
                                  InvalidRequestError, PrefixNotCachedError, CommandExpired,
                                  MigrationFailed, MigrationRefused, MalformedMessage)}
