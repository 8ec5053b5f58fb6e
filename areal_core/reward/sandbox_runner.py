"""The program that runs as pid 1 inside every sandbox (copied to /task/_runner.py; stdlib only).

    python -I -S -B /task/_runner.py main  STATUS_FD
    python -I -S -B /task/_runner.py serve STATUS_FD REQUEST_FD RESPONSE_FD

It forks the candidate and waits for it. Being pid 1 of the sandbox's pid namespace, nothing
inside can kill it (the kernel drops SIGKILL sent to a namespace's init from inside), so it
always reports how the candidate ended: one line `exit N` or `signal N` on STATUS_FD, taken
from the real wait status (an `exit 137` and a SIGKILL are told apart). When it exits, the
kernel kills whatever the candidate left behind.

* `main`: /task/main.py runs as `__main__` with the test's stdin; its stdout is the verdict's
  input, compared outside the sandbox.
* `serve`: /task/solution.py is loaded once as module `solution` (the "zygote"). For each test
  the host sends `begin` with the names the test needs; the zygote forks a worker (fresh state,
  fresh CPU time) that answers with the manifest of those names, then serves `call` messages
  (arguments in, the return value and the changed arguments back, all in the typed encoding of
  `/task/_codec.py`) until `end`; then the zygote reports the worker's end (`{"ended": ...}`).
  Messages are 4-byte big-endian lengths followed by JSON.

Nothing here decides a verdict: the tests run on the host, which only ever receives plain data.
Whatever the program does to this interpreter, it can only change the values it reports.
"""

import os
import sys


def text_of(exc):
    try:
        return str(exc)[:300]
    except BaseException:
        return ""


def describe(exc):
    text = text_of(exc)
    return (type(exc).__name__ + (": " + text if text else ""))[:300]


def status_line(status):
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit {os.WEXITSTATUS(status)}"


def run_main():
    import builtins

    sys.argv = ["/task/main.py"]
    with open("/task/main.py") as f:
        code = compile(f.read(), "/task/main.py", "exec")
    exec(code, {"__name__": "__main__", "__file__": "/task/main.py", "__builtins__": builtins})
    # falling off the end: the interpreter exits as it would after `python main.py`


class Channel:
    def __init__(self, codec, req_fd, resp_fd):
        self.codec, self.req, self.resp = codec, req_fd, resp_fd

    def _read(self, n):
        data = b""
        while len(data) < n:
            chunk = os.read(self.req, n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def recv(self):
        head = self._read(4)
        body = self._read(int.from_bytes(head, "big")) if head else None
        return None if body is None else self.codec.loads(body)

    def send(self, message):
        data = self.codec.dumps(message)
        data = len(data).to_bytes(4, "big") + data
        while data:
            data = data[os.write(self.resp, data) :]


def manifest(codec, ns, names):
    import types

    out = {}
    for name in names:
        if type(name) is not str or name not in ns:
            continue
        value = ns[name]
        if isinstance(value, types.ModuleType):
            out[name] = ["module", str(getattr(value, "__name__", ""))]
        elif callable(value):
            out[name] = ["function"]
        else:
            try:
                out[name] = ["value", codec.encode(value)]
            except Exception:
                pass
    return out


_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes)


def call(codec, ns, msg):
    name = msg.get("name")
    fn = ns.get(name) if type(name) is str else None
    if not callable(fn):
        return {"fail": f"{str(name)[:60]} is not a function of the program"}
    args = [codec.decode(a) for a in msg["args"]]
    kwargs = {k: codec.decode(v) for k, v in msg["kwargs"]}
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:
        return {"raise": type(exc).__name__, "message": text_of(exc)}
    try:
        out = {"value": codec.encode(value)}
        changed = []
        for key, sent, now in [(i, t, a) for i, (t, a) in enumerate(zip(msg["args"], args))] + [
            (k, t, kwargs[k]) for k, t in msg["kwargs"]
        ]:
            if type(now) not in _IMMUTABLE:
                tree = codec.encode(now)
                if tree != sent:
                    changed.append([key, tree])
        if changed:
            out["changed"] = changed
        return out
    except codec.Uncrossable as exc:
        return {"fail": f"the return value of {name}(...): {exc}"}


def worker(chan, ns, names):
    chan.send({"manifest": manifest(chan.codec, ns, names)})
    while True:
        msg = chan.recv()
        if not isinstance(msg, dict) or msg.get("op") != "call":
            os._exit(0)  # `end`, the host went away, or nonsense: this test is over
        try:
            reply = call(chan.codec, ns, msg)
        except Exception as exc:
            reply = {"fail": "bad call: " + describe(exc)}
        chan.send(reply)


def run_serve(req_fd, resp_fd):
    import builtins
    import importlib.util

    spec = importlib.util.spec_from_file_location("_codec", "/task/_codec.py")
    codec = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codec)
    chan = Channel(codec, req_fd, resp_fd)
    sys.stdin = open(os.devnull)
    ns = {"__name__": "solution", "__builtins__": builtins}
    try:
        with open("/task/solution.py") as f:
            exec(compile(f.read(), "solution.py", "exec"), ns)
    except BaseException as exc:  # the program failed (or left) before the tests
        os.write(2, ("\n" + describe(exc) + "\n").encode())
        os._exit(1)
    while True:
        msg = chan.recv()
        if not isinstance(msg, dict) or msg.get("op") != "begin":
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            worker(chan, ns, list(msg.get("names") or []))
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        chan.send({"ended": status_line(status)})


def main():
    mode, status_fd = sys.argv[1], int(sys.argv[2])
    channel = [int(fd) for fd in sys.argv[3:5]] if mode == "serve" else []
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        if mode == "serve":
            run_serve(*channel)
        else:
            run_main()
        return
    for fd in channel:  # the candidate holds the channel alone: its end is the host's EOF
        os.close(fd)
    while True:  # as init, also reap whatever the candidate orphaned
        try:
            done, status = os.wait()
        except ChildProcessError:
            os._exit(3)
        if done == pid:
            break
    os.write(status_fd, (status_line(status) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
