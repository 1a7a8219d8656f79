"""Typed errors raised by the engine. Operator commands and bad input raise these;
callers (the service, the CLI) turn them into messages a user can act on."""


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


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


class PrefixNotCachedError(EngineError):
    """A pin/unpin named a prefix that has no cached block."""


class CommandExpired(EngineError):
    """A command reached the engine after its caller's deadline: it was not applied."""
