"""A service a command depends on stopped answering: the retrieval service or the policy server.

Both stop a command the same way: exit status 75 (sysexits' EX_TEMPFAIL, "try again later") and one paragraph
that names the service, its last error and how to continue (`eviback train ... --resume`, or the same
`eviback eval` command, once the service answers again). The commands find the error through whatever
exceptions wrap it (:meth:`ServiceUnavailable.found_in`).
"""

from __future__ import annotations

from collections.abc import Iterator

# The exit status of a command stopped by something outside it that passes (a service that stopped answering,
# a full disk): sysexits' EX_TEMPFAIL. What it did is kept; the same command (with --resume for a training run)
# goes on once the cause is gone.
RESUMABLE_EXIT = 75


class ServiceUnavailable(RuntimeError):
    """The base of the errors of a service that stopped answering; `url` is the service's."""

    url: str
    service = "the service"  # what the paragraphs call it: "the retrieval service", "the policy server"
    # The exit status of a command it stops: the same command (with --resume for a training run) continues once
    # the service is back.
    exit_code = RESUMABLE_EXIT

    def reason(self) -> str:
        """What went wrong, after the service's name and URL: "did not answer for 300 s (...)"."""
        raise NotImplementedError

    def restart(self) -> str:
        """How the service is brought back, in a few words (a command)."""
        raise NotImplementedError

    def describe(self) -> str:
        """`the <service> at <url> <reason>`: the opening of the commands' paragraphs."""
        return f"{self.service} at {self.url} {self.reason()}"

    @classmethod
    def found_in(cls, error: BaseException) -> ServiceUnavailable | None:
        """The error of this class that `error` is, or was raised from or during (through any exceptions that
        wrap it, short of one raised `from None`), or None."""
        return next((e for e in error_chain(error) if isinstance(e, cls)), None)


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, then what it was raised from or during, and so on (each once), short of an error raised `from
    None`, which hid its context on purpose (e.g. a refusal at the start)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        yield current
        seen.add(id(current))
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
