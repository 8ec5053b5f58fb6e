"""The program that runs as pid 1 inside every sandbox (copied to /task/_runner.py; stdlib only).

    python -I -S -B /task/_runner.py main  STATUS_FD
    python -I -S -B /task/_runner.py tests STATUS_FD RESULTS_FD

It forks the candidate and waits for it. Being pid 1 of the sandbox's pid namespace, nothing
inside can kill it (the kernel drops SIGKILL sent to a namespace's init from inside), so it
always reports how the candidate ended: one line `exit N` or `signal N` on STATUS_FD, taken
from the real wait status (an `exit 137` and a SIGKILL are told apart). When it exits, the
kernel kills whatever the candidate left behind.

* `main`: /task/main.py runs as `__main__` with the test's stdin; its stdout is the verdict's
  input, compared outside the sandbox.
* `tests`: /task/solution.py runs as module `solution`, then the steps of /task/plan.json in
  its namespace: `exec` steps (statements of the test) and `eval` steps (the expressions whose
  values the asserts compare). Each value is written to RESULTS_FD as JSON, with exact types
  (a subclass of int, or an object with its own `__eq__`, is an error, not a value). The
  expected values and the comparisons are not in the plan: they stay outside, where the host
  compares. Whatever the program does to this interpreter, it can only change the values it
  reports, which it must then get right.
"""

import os
import sys


def encode(value, depth=0):
    """A plain value as JSON with its exact type; anything else raises TypeError."""
    if depth > 100:
        raise ValueError("value nested deeper than 100 levels")
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is int:
        return value
    if kind is float:
        return {"float": repr(value)}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple or kind is set or kind is frozenset:
        return {kind.__name__: [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [repr(value.real), repr(value.imag)]}
    raise TypeError(f"a {kind.__name__} cannot be compared outside the sandbox (plain values only)")


def describe(exc):
    text = str(exc)
    return (type(exc).__name__ + (": " + text if text else ""))[:300]


def run_main():
    import builtins

    sys.argv = ["/task/main.py"]
    with open("/task/main.py") as f:
        code = compile(f.read(), "/task/main.py", "exec")
    exec(code, {"__name__": "__main__", "__file__": "/task/main.py", "__builtins__": builtins})
    # falling off the end: the interpreter exits as it would after `python main.py`


def run_tests(results_fd):
    import builtins
    import json

    with open("/task/plan.json") as f:
        steps = json.load(f)["steps"]

    def emit(record):
        data = (json.dumps(record) + "\n").encode()
        while data:
            data = data[os.write(results_fd, data) :]

    sys.stdin = open(os.devnull)
    ns = {"__name__": "solution", "__builtins__": builtins}
    try:
        with open("/task/solution.py") as f:
            exec(compile(f.read(), "solution.py", "exec"), ns)
    except BaseException as exc:  # the program failed (or left) before the tests
        os.write(2, ("\n" + describe(exc) + "\n").encode())
        os._exit(1)
    for i, step in enumerate(steps):
        try:
            if step["kind"] == "exec":
                exec(compile(step["src"], "test.py", "exec"), ns)
                continue
            value = eval(compile(step["src"], "test.py", "eval"), ns)
            record = {"id": step["id"], "value": encode(value)}
        except BaseException as exc:
            if step["kind"] == "exec":
                emit({"step": i, "error": describe(exc)})
                break
            record = {"id": step["id"], "error": describe(exc)}
        emit(record)
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    emit({"done": True})
    os._exit(0)


def main():
    mode, status_fd = sys.argv[1], int(sys.argv[2])
    results_fd = int(sys.argv[3]) if mode == "tests" else -1
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        if mode == "tests":
            run_tests(results_fd)
        else:
            run_main()
        return
    if results_fd >= 0:
        os.close(results_fd)
    while True:  # as init, also reap whatever the candidate orphaned
        try:
            done, status = os.wait()
        except ChildProcessError:
            os._exit(3)
        if done == pid:
            break
    if os.WIFSIGNALED(status):
        line = f"signal {os.WTERMSIG(status)}\n"
    else:
        line = f"exit {os.WEXITSTATUS(status)}\n"
    os.write(status_fd, line.encode())
    os._exit(0)


if __name__ == "__main__":
    main()
