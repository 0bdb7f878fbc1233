"""Report training progress to fsdp-agent, so it can tell a hung group from a slow one.

    from progress import step, phase
    for n, batch in enumerate(loader, 1):
        train(batch)
        step(n)
    with phase("checkpoint"):
        save()
    finish()   # optional: the interpreter's exit reports it anyway

Without fsdp-agent (FSDP_AGENT_PROGRESS unset) every call does nothing.
"""
import atexit
import contextlib
import os
import socket
import time

_path = os.environ.get("FSDP_AGENT_PROGRESS")
_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if _path else None
if _sock is not None:
    # A busy agent drops a report; it never stalls training.
    _sock.setblocking(False)
_rank = os.environ.get("RANK", "0")


def _say(kind, arg, tries=1):
    # A phase's begin and end matter more than one step: they wait up to ~0.1 s for room.
    for _ in range(tries):
        if _sock is None:
            return
        try:
            _sock.sendto(f"{_rank} {kind} {arg}".encode(), _path)
            return
        except BlockingIOError:
            time.sleep(0.002)
        except OSError:
            return  # the agent is gone: training goes on


def step(n, busy=None):
    """Step `n` finished. `busy`: the seconds this rank worked in it, not counting time
    blocked in collectives (waiting for its peers); with it the agent can name a slow rank
    (a straggler), which in a synchronous job takes as long per step as every other."""
    if busy is None:
        _say("step", int(n))
    else:
        _say("step", f"{int(n)} {float(busy):.6f}")


@contextlib.contextmanager
def phase(name):
    """A long stretch without steps (a checkpoint, an evaluation): judged by its own allowance."""
    _say("begin", name, tries=50)
    try:
        yield
    finally:
        _say("end", name, tries=50)


_finished = False


def finish():
    """Training is over: what follows (a final save, destroy_process_group, the
    interpreter's teardown) is judged by the 'finish' allowance, not timed as a step."""
    global _finished
    if not _finished:  # once: the allowance runs from the first call, not from the exit
        _finished = True
        _say("begin", "finish", tries=50)


if _sock is not None:
    atexit.register(finish)
