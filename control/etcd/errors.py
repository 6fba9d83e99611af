"""The etcd client's exceptions: one base, and one class per thing a caller decides differently on.

Each message names the endpoint (or every endpoint tried), the operation and the key where there is
one, so a log line alone tells an operator where to look.
"""

from __future__ import annotations

# gRPC status codes etcd's gateway puts in an error's ``code``.
NOT_FOUND = 5
PERMISSION_DENIED = 7
OUT_OF_RANGE = 11
UNAVAILABLE = 14
UNAUTHENTICATED = 16


class EtcdError(Exception):
    """Anything the etcd client could not do."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered: every one refused the connection, timed out, or lost the answer.

    ``outcome_unknown`` is true for a write whose request may have reached etcd before the connection
    broke: it was not retried (a second put or txn is not the same as one), so the caller must read
    back before assuming either way."""

    def __init__(self, message: str, *, outcome_unknown: bool = False) -> None:
        super().__init__(message)
        self.outcome_unknown = outcome_unknown


class EtcdRequestError(EtcdError):
    """etcd answered and refused the request; ``code`` is its gRPC status code (5 not found, 7
    permission denied, 9 failed precondition, 11 out of range, 16 unauthenticated...)."""

    def __init__(self, message: str, *, code: int, endpoint: str, operation: str) -> None:
        super().__init__(message)
        self.code = code
        self.endpoint = endpoint
        self.operation = operation


class EtcdAuthError(EtcdRequestError):
    """The user name or password was refused, or the user lacks the permission the request needs."""


class EtcdCompacted(EtcdError):
    """A watch or a range asked for a revision etcd has already compacted away: the changes in
    between are gone, so the caller must read the whole prefix again (``compact_revision`` is the
    oldest revision still available, as a watch is told; 0 for a range, which is not)."""

    def __init__(self, message: str, *, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class EtcdLeaseLost(EtcdError):
    """A lease expired or was revoked, or could not be renewed before it may have expired: whatever
    it held (a leader key) must be treated as gone."""


class EtcdProtocolError(EtcdError):
    """etcd's answer was not what its JSON gateway sends (a field of the wrong type, a line too long):
    a proxy in between, or a different server on that port."""


def refusal(what: str, endpoint: str, operation: str, code: int, message: str) -> EtcdError:
    """The exception for etcd's refusal of ``what`` (its gRPC ``code`` and ``message``)."""
    text = f"{what}: {endpoint} refused: {message}"
    if "user name is empty" in message:
        # etcd's words for a request without a token to a cluster with auth enabled.
        text += " (etcd has authentication enabled: configure a user and password)"
        return EtcdAuthError(text, code=code, endpoint=endpoint, operation=operation)
    if code in (PERMISSION_DENIED, UNAUTHENTICATED) or "authentication failed" in message:
        return EtcdAuthError(text, code=code, endpoint=endpoint, operation=operation)
    if code == OUT_OF_RANGE and "compacted" in message:
        return EtcdCompacted(text, compact_revision=0)
    return EtcdRequestError(text, code=code, endpoint=endpoint, operation=operation)
