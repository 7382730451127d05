"""Errors raised by the Kafka-facing layer: admin, clients and broker launchers."""

from __future__ import annotations

import ssl
from collections.abc import Iterable

from aiokafka import errors as kafka_errors
from deferline.schemas import DeferlineError


class BrokerError(DeferlineError):
    """Talking to, or starting, a Kafka-protocol broker failed."""


class TopicLayoutError(BrokerError):
    """Existing topics break deferline's layout (two topics that must be co-partitioned are not)."""


class BrokerStartError(BrokerError):
    """A broker process could not be assembled, started or reached."""


class AccessError(BrokerError):
    """The broker refused this client: who it is, or what it may do."""


class AuthenticationError(AccessError):
    """The broker refused the credentials, or the TLS handshake failed (untrusted CA...)."""


class AuthorizationError(AccessError):
    """The principal authenticated but has no ACL for a topic, group, transactional id or
    the cluster."""

    def __init__(self, message: str, *, resources: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.resources = list(resources)
        """The topics (or group...) refused, when known."""


class InvalidQueueName(DeferlineError, ValueError):
    """A trigger or worker queue name is not usable in a topic name."""


_AUTHORIZATION = (
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.GroupAuthorizationFailedError,
    kafka_errors.ClusterAuthorizationFailedError,
    kafka_errors.TransactionalIdAuthorizationFailed,
)
_AUTHENTICATION = (
    kafka_errors.SaslAuthenticationFailed,
    kafka_errors.AuthenticationFailedError,
    kafka_errors.UnsupportedSaslMechanismError,
    kafka_errors.IllegalSaslStateError,
    kafka_errors.AuthenticationMethodNotSupported,
    ssl.SSLError,
)
_KIND = {
    kafka_errors.TopicAuthorizationFailedError: "topic",
    kafka_errors.GroupAuthorizationFailedError: "group",
    kafka_errors.ClusterAuthorizationFailedError: "cluster",
    kafka_errors.TransactionalIdAuthorizationFailed: "transactional id",
}


def _chain(exc: BaseException) -> Iterable[BaseException]:
    """``exc``, its causes, and those of every exception an exception group holds (a
    process's task group reports a failed task that way)."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        current: BaseException | None = stack.pop()
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            yield current
            if isinstance(current, BaseExceptionGroup):
                stack.extend(reversed(current.exceptions))
            current = current.__cause__ or current.__context__


def access_error(
    exc: BaseException,
    *,
    principal: str | None = None,
    resources: Iterable[str] = (),
    action: str | None = None,
) -> AccessError | None:
    """The AccessError an authentication or authorization failure in ``exc``'s cause chain
    amounts to, naming the broker's error, the resources and the principal; else None.

    An AccessError already in the chain is returned as it is.
    """
    for link in _chain(exc):
        if isinstance(link, AccessError):
            return link
    for link in _chain(exc):
        if isinstance(link, _AUTHORIZATION):
            kind = _KIND.get(type(link), "resource")
            names = ", ".join(resources) or _named_in(link)
            what = f"{kind} {names}" if names else kind
            who = f" principal {principal}" if principal else " this principal"
            doing = f" ({action})" if action else ""
            error = AuthorizationError(
                f"not authorized: the broker answered {type(link).__name__} for {what}:"
                f"{who} has no ACL allowing it{doing}. Grant the role's ACLs "
                "(docs/operations.md, `deferline topics ensure --acls ROLE=PRINCIPAL`)."
            )
            error.__cause__ = link
            return error
        if isinstance(link, _AUTHENTICATION):
            who = f" as {principal}" if principal else ""
            reason = str(link) or type(link).__name__
            failed = AuthenticationError(
                f"authentication failed{who}: {type(link).__name__}: {reason}. Check the SASL "
                "user, password and mechanism, and that --ssl-cafile holds the CA that signed "
                "the brokers' certificates."
            )
            failed.__cause__ = link
            return failed
    return None


def _named_in(exc: BaseException) -> str:
    """Topic or group names aiokafka put in the error's arguments, if any."""
    names: list[str] = []
    for arg in exc.args:
        if isinstance(arg, set | frozenset | list | tuple):
            names += [str(item) for item in arg]
        elif isinstance(arg, str) and arg and " " not in arg:
            names.append(arg)
    return ", ".join(sorted(names))
