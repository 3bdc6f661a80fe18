"""Domain errors. Each names the gRPC status it is answered with, so one interceptor maps
them all and the client can raise the same classes back to its callers."""


class RouteReplayError(Exception):
    """Base class. ``status`` is the name of a ``grpc.StatusCode``; ``retry_after_s``, when
    set, how long the caller should wait before trying again (sent as the call's
    ``retry-after-ms`` trailer)."""

    status = "INTERNAL"

    def __init__(self, *args, retry_after_s: float | None = None):
        super().__init__(*args)
        self.retry_after_s = retry_after_s


class InvalidArgument(RouteReplayError):
    status = "INVALID_ARGUMENT"


class NotFound(RouteReplayError):
    status = "NOT_FOUND"


class AlreadyExists(RouteReplayError):
    status = "ALREADY_EXISTS"


class FailedPrecondition(RouteReplayError):
    status = "FAILED_PRECONDITION"


class Unavailable(RouteReplayError):
    status = "UNAVAILABLE"


class ResourceExhausted(RouteReplayError):
    """Over a limit: a server's, or the route cache's memory budget (then with
    ``retry_after_s``: the write is refused whole, and the trainer frees memory as it commits)."""

    status = "RESOURCE_EXHAUSTED"


class DataLoss(RouteReplayError):
    """Stored or received bytes fail their checksum."""

    status = "DATA_LOSS"


class DeadlineExceeded(RouteReplayError):
    """The caller's time-out passed before an answer came (raised by the clients, never
    answered by a server)."""

    status = "DEADLINE_EXCEEDED"


class CaptureError(RouteReplayError):
    """The engine's captured routes are missing or implausible (answered as INTERNAL).

    Raised instead of returning routes that would silently corrupt training:
    the known failure is a block of zeros of the right shape (expert 0, k
    times), which the distinct-within-top-k check catches.
    """

    status = "INTERNAL"


# The trailer that carries ``retry_after_s`` (milliseconds, an integer).
RETRY_AFTER_TRAILER = "retry-after-ms"

BY_STATUS = {
    cls.status: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        Unavailable,
        ResourceExhausted,
        DataLoss,
        DeadlineExceeded,
    )
}
