"""Report training progress to fsdp-agent, so it can tell a hung group from a slow one.

    from progress import step, phase
    for n, batch in enumerate(loader, 1):
        train(batch)
        step(n)
    with phase("checkpoint"):
        save()

Without fsdp-agent (FSDP_AGENT_PROGRESS unset) every call does nothing.
"""
import contextlib
import os
import socket

_path = os.environ.get("FSDP_AGENT_PROGRESS")
_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if _path else None
_rank = os.environ.get("RANK", "0")


def _say(kind, arg):
    if _sock is not None:
        try:
            _sock.sendto(f"{_rank} {kind} {arg}".encode(), _path)
        except OSError:
            pass  # the agent is gone or busy: training goes on


def step(n):
    """Step `n` finished."""
    _say("step", int(n))


@contextlib.contextmanager
def phase(name):
    """A long stretch without steps (a checkpoint, an evaluation): judged by its own allowance."""
    _say("begin", name)
    try:
        yield
    finally:
        _say("end", name)
