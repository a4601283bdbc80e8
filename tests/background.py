"""Module fixtures whose work starts when the session starts, in one background thread.

A test module names such fixtures in a module-level dict, `BACKGROUND = {"fixture": producer}`,
where `producer` is a function of session fixtures (by parameter name, e.g. `tmp_path_factory`,
`books_data`) that does the fixture's whole work in subprocesses. When a selected test uses the
fixture, `started` (tests/conftest.py, at the session's start) runs the producer in a background
thread; the fixture's `result(...)` then waits for it and returns its value or raises its error
(an assert, a pytest.fail) in the test that reads it. A producer's subprocesses get
SESSION_ENV, not os.environ, which the tests running meanwhile change. A run of a few tests whose fixture was not
started computes it in the foreground, as any fixture.

Why: a pipeline of subprocesses (the tutorial's commands, the reproduction studies) keeps about
one of the machine's two cores busy; run beside the in-process tests, which keep the other, the
suite takes about that much less time, and every check still runs. The background runs one
job at a time (tests/jobs.py side_by_side): more jobs than cores slow every process many times.
"""

import inspect
import threading
from collections.abc import Callable

from tests.jobs import BACKGROUND_THREAD, Outcome, end_jobs

SESSION_ENV: dict[str, str] = {}  # os.environ as the session began (tests/conftest.py)
RESULTS: dict[str, Outcome] = {}
SCHEDULED: set[str] = set()
THREAD: list[threading.Thread] = []


def declared(items) -> dict[str, Callable]:
    """The producers of the BACKGROUND fixtures the selected tests use, in the tests' order."""
    found: dict[str, Callable] = {}
    for item in items:
        module = getattr(item, "module", None)
        for name, producer in getattr(module, "BACKGROUND", {}).items():
            if name in getattr(item, "fixturenames", ()):
                found.setdefault(name, producer)
    return found


def start(work: dict[str, tuple[Callable, dict]]) -> None:
    """Run each producer with its arguments, one after the other, in one background thread."""

    def run() -> None:
        for name, (producer, kwargs) in work.items():
            try:
                RESULTS[name] = Outcome(producer(**kwargs))
            except BaseException as err:  # noqa: BLE001 (raised again in the fixture's test)
                RESULTS[name] = Outcome(error=err)
            end_jobs()  # a job its producer left running (an assert mid-job)

    if work:
        SCHEDULED.update(work)
        THREAD.append(threading.Thread(target=run, name=BACKGROUND_THREAD, daemon=True))
        THREAD[0].start()


def arguments(producer: Callable) -> list[str]:
    return list(inspect.signature(producer).parameters)


def result(name: str, compute: Callable[[], object]):
    """The fixture `name`'s value: the background thread's, once it is there, else `compute()`."""
    if name in SCHEDULED:
        while name not in RESULTS and THREAD[0].is_alive():
            THREAD[0].join(1)
    if name in RESULTS:
        SCHEDULED.discard(name)
        return RESULTS.pop(name).get()
    return compute()


def finish() -> None:
    """At the session's end: the background work ends before the session does (its
    subprocesses have their own time limits)."""
    for thread in THREAD:
        thread.join()
