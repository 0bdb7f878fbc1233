# A pre-warmed worker (fsdp-agent --prewarm). The agent starts it as
#
#   python -u -c "<launcher>" <source fd> <socket fd> <modules> <the worker's arguments>
#
# where the worker's arguments are those a cold start gives the interpreter after its
# options (`script args`, `-m module args` or `-c code args`). The launcher reads this
# source from <source fd> and runs it in a namespace of its own, so `__main__` stays as a
# fresh interpreter has it.
#
# Protocol on the socket (a stream, shared with the agent):
#   spare -> agent  b"R"                  the modules are imported; waiting for orders
#                   b"E" + message, EOF   an import failed; the spare exits
#   agent -> spare  8-byte big-endian length, then NUL-separated fields:
#                   argc, argv..., envc, KEY=VALUE..., cwd
#                   with two descriptors attached: the worker's stdout and stderr
#   spare -> agent  b"G"                  the orders are applied; the script runs now
# EOF from the agent before the orders: the spare is not needed and exits.
import os
import socket
import sys

_HERE = "<fsdp-agent spare>"


def _path0(args):
    """sys.path[0] as the interpreter sets it for a cold start with these arguments."""
    if getattr(sys.flags, "safe_path", False):
        return None
    if args[0] == "-c":
        return ""
    if args[0] == "-m":
        return os.getcwd()
    return os.path.dirname(os.path.realpath(args[0]))


def _set_path0(args):
    # The launcher ran with `-c`, whose sys.path[0] is "".
    p0 = _path0(args)
    if p0 is not None and sys.path:
        sys.path[0] = p0


def _unsupported(args):
    """Why this entrypoint cannot be run warm, or None."""
    if args[0] in ("-c", "-m"):
        return None if len(args) > 1 else "no code or module after " + args[0]
    try:
        with open(args[0], "rb") as f:
            head = f.read(4)
    except OSError as e:
        return "cannot read %s: %s" % (args[0], e)
    if head == b"PK\x03\x04":
        return "%s is a zip archive" % args[0]
    return None


def _read_exact(sock, n, chunks):
    got = sum(len(c) for c in chunks)
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return False
        chunks.append(chunk)
        got += len(chunk)
    return True


def _orders(sock):
    """(argv, env, cwd, [stdout fd, stderr fd]) or None when the agent hung up."""
    head, fds, _, _ = socket.recv_fds(sock, 8, 2)
    chunks = [head]
    if not head or not _read_exact(sock, 8, chunks):
        return None
    raw = b"".join(chunks)
    length = int.from_bytes(raw[:8], "big")
    body = [raw[8:]]
    if not _read_exact(sock, length, body):
        return None
    fields = b"".join(body).split(b"\0")
    argc = int(fields[0])
    argv = [os.fsdecode(a) for a in fields[1 : 1 + argc]]
    envc = int(fields[1 + argc])
    env = fields[2 + argc : 2 + argc + envc]
    cwd = fields[2 + argc + envc]
    return argv, env, cwd, fds


def _become(argv, env, cwd, fds):
    os.chdir(cwd)
    os.environb.clear()
    for item in env:
        key, _, value = item.partition(b"=")
        os.environb[key] = value
    out, err = fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)


# `__main__` as the interpreter made it: the launcher binds no names there.
_MAIN = dict(sys.modules["__main__"].__dict__)


def _fresh_main():
    globs = sys.modules["__main__"].__dict__
    globs.clear()
    globs.update(_MAIN)
    return globs


def _run(args):
    """Runs the worker's arguments as `python -u <args>` would."""
    import runpy

    globs = _fresh_main()
    if args[0] == "-m":
        sys.argv = ["-m"] + args[2:]
        runpy._run_module_as_main(args[1], alter_argv=True)
        return
    if args[0] == "-c":
        sys.argv = ["-c"] + args[2:]
        code = compile(args[1], "<string>", "exec", dont_inherit=True)
    else:
        import importlib.machinery

        sys.argv = list(args)
        # Since Python 3.9 the interpreter names the script by its absolute path.
        path = os.path.abspath(args[0])
        with open(path, "rb") as f:
            source = f.read()
        code = compile(source, path, "exec", dont_inherit=True)
        globs["__file__"] = path
        globs["__cached__"] = None
        globs["__loader__"] = importlib.machinery.SourceFileLoader("__main__", path)
    exec(code, globs)


def _strip(tb):
    """The traceback from the first frame of the worker's own code on."""
    while tb is not None and tb.tb_frame.f_code.co_filename == _HERE:
        tb = tb.tb_next
    return tb


def main():
    # sys.argv: ["-c", source fd, socket fd, modules, the worker's arguments...]
    os.close(int(sys.argv[1]))
    fd, modules, args = int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=fd)
    why = _unsupported(args)
    if why is None:
        _set_path0(args)
        try:
            for name in filter(None, modules.split(",")):
                __import__(name)
        except BaseException as e:  # noqa: BLE001 - any failure is reported, not raised
            why = "import %s failed: %s: %s" % (name, type(e).__name__, e)
    if why is not None:
        sock.sendall(b"E" + why.encode("utf-8", "replace"))
        sock.close()
        return
    sock.sendall(b"R")
    orders = _orders(sock)
    if orders is None:
        return
    argv, env, cwd, fds = orders
    _become(argv, env, cwd, fds)
    sock.sendall(b"G")
    sock.close()
    del sock
    sys.orig_argv = [sys.executable, "-u"] + argv
    _set_path0(argv)
    try:
        _run(argv)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        # As the interpreter reports an uncaught exception, without this file's frames.
        # (The hook prints the exception's own traceback, so that is what is trimmed.)
        e.with_traceback(_strip(e.__traceback__))
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)


main()
