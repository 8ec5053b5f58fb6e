"""What a job is, in plain Python that neither Flyte SDK knows: its inputs (name, type, default, doc),
its output, its steps, its cache versions and its schedule; and the one function both front ends
turn a job into an SDK entity with (`function`).

`function(job, body, ...)` is a Python function whose signature (`inspect.signature`, read by
`@workflow` and by Flyte 2's `@env.task`), annotations (`typing.get_type_hints`), docstring (its
`:param` lines: pyflyte's help, the inputs' descriptions in both SDKs' interfaces), name and module
are the job's. Calling it
binds the arguments against that signature (defaults applied) and hands them to `body` as one
`Given` namespace, so an input the body does not read needs no edit of the body.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

REQUIRED = inspect.Parameter.empty  # an input without a default


@dataclasses.dataclass(frozen=True)
class Input:
    """One input of a job: what a user passes (pyflyte `--name`, `flyte run --name`)."""

    name: str
    type: Any
    doc: str
    default: Any = REQUIRED


@dataclasses.dataclass(frozen=True)
class Record:
    """A job's (or step's) output of several named values; each front end makes its own class of it
    (`named_tuple` for flytekit, `dataclass` for Flyte 2), one per record."""

    name: str
    fields: tuple[tuple[str, type], ...]

    def named_tuple(self) -> type:
        return _named_tuple(self)

    def dataclass(self) -> type:
        return _dataclass(self)


@functools.cache
def _named_tuple(record: Record) -> type:
    return typing.NamedTuple(record.name, list(record.fields))  # type: ignore[misc]


@functools.cache
def _dataclass(record: Record) -> type:
    cls = dataclasses.make_dataclass(record.name, list(record.fields))
    cls.__module__ = __name__
    return cls


@dataclasses.dataclass(frozen=True)
class Plan:
    """A schedule as its front end needs it: the cron expression, the inputs a scheduled run gets
    (besides its kickoff time, bound to `kickoff_input`), and who is e-mailed when one fails, times
    out or is aborted."""

    cron: str
    inputs: dict[str, Any]
    notify: tuple[str, ...]
    kickoff_input: str = "kickoff_time"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A job's schedule (a flytekit launch plan, a Flyte 2 trigger). `plan` is asked for when the
    front end needs it: it may read the cluster config, which importing a job never does."""

    name: str
    description: str
    plan: Callable[[], Plan]


@dataclasses.dataclass(frozen=True)
class Cache:
    """A cached step: its result depends on `key` alone (never on the `ignored` inputs); bump
    `version` when the step's code changes what it produces for the same key."""

    step: str
    version: str
    ignored: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Job:
    """One job: `doc` is the summary line of its docstring, `steps` what it runs, in order (the
    names of jobs/steps.py), `output` a Record or a plain type."""

    name: str
    doc: str
    inputs: tuple[Input, ...]
    output: Any
    steps: tuple[str, ...]
    schedule: Schedule | None = None

    def input(self, name: str) -> Input:
        return next(i for i in self.inputs if i.name == name)


class Given(SimpleNamespace):
    """A job's arguments, bound and with defaults applied: `given.cfg`, `given.overrides` ..."""

    def take(self, *names: str, **renamed: str) -> dict[str, Any]:
        """Keyword arguments of a step: the inputs `names`, and each `step_name=input_name` of `renamed`."""
        return {name: getattr(self, name) for name in names} | {k: getattr(self, v) for k, v in renamed.items()}


def docstring(job: Job, extra: tuple[Input, ...] = ()) -> str:
    """The job's docstring: its summary, then one `:param name: doc` line per input."""
    params = "\n".join(f":param {i.name}: {i.doc}" for i in (*job.inputs, *extra))
    return f"{job.doc}\n\n{params}\n"


def signature(job: Job, returns: Any, extra: tuple[Input, ...] = ()) -> inspect.Signature:
    """The job's inputs (then `extra`) as parameters, in order, with their types and defaults."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(i.name, kind, default=i.default, annotation=i.type) for i in (*job.inputs, *extra)]
    return inspect.Signature(params, return_annotation=returns)


def function(
    job: Job,
    body: Callable[[Given], Any],
    returns: Any,
    extra: tuple[Input, ...] = (),
    name: str = "",
    doc: str = "",
) -> Callable[..., Any]:
    """A function with the job's signature (its inputs, then `extra`), annotations, docstring and name
    (or `name`, and `doc` as the summary), in the body's module, that calls `body(Given(...))`; a
    coroutine function when `body` is one."""
    sig = signature(job, returns, extra)

    def given(args: tuple, kwargs: dict) -> Given:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return Given(**bound.arguments)

    if inspect.iscoroutinefunction(body):

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await body(given(args, kwargs))

    else:

        def call(*args: Any, **kwargs: Any) -> Any:
            return body(given(args, kwargs))

    call.__signature__ = sig  # type: ignore[attr-defined]
    call.__wrapped__ = body  # type: ignore[attr-defined] # a module-level function, to flytekit (and its source)
    call.__annotations__ = {p.name: p.annotation for p in sig.parameters.values()} | {"return": returns}
    call.__name__ = call.__qualname__ = name or job.name
    call.__module__ = body.__module__
    call.__doc__ = docstring(dataclasses.replace(job, doc=doc or job.doc), extra)
    return call


def doc_of(step: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a front end's task the docstring of the step it calls (jobs/steps.py): one text for both."""

    def described(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__doc__ = step.__doc__
        return fn

    return described
