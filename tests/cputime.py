"""`pytest --cpu-durations N`: the N tests that used the most CPU seconds, their own and their
subprocesses' (the launches' ranks included, once the launcher has waited for them). On a loaded
box wall-clock durations measure the neighbours too; CPU seconds measure the test."""

import resource

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-durations",
        type=int,
        default=None,
        metavar="N",
        help="show the N tests that used the most CPU seconds, subprocesses included (0: all)",
    )


def _cpu_s() -> float:
    used = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        used += usage.ru_utime + usage.ru_stime
    return used


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = _cpu_s()
    item.user_properties.append(("cpu_s", 0.0))
    slot = len(item.user_properties) - 1

    def stamp() -> None:
        item.user_properties[slot] = ("cpu_s", _cpu_s() - start)

    item.stash[STAMP] = stamp
    yield


STAMP = pytest.StashKey()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if STAMP in item.stash:
        item.stash[STAMP]()
    yield


class Totals:
    def __init__(self):
        self.cpu: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "teardown":
            cpu = dict(report.user_properties).get("cpu_s")
            if cpu is not None:
                self.cpu[report.nodeid] = float(cpu)

    def pytest_terminal_summary(self, terminalreporter, config):
        n = config.getoption("cpu_durations")
        ranked = sorted(self.cpu.items(), key=lambda kv: -kv[1])
        by_module: dict[str, float] = {}
        for nodeid, cpu in ranked:
            module = nodeid.split("::")[0]
            by_module[module] = by_module.get(module, 0.0) + cpu
        tr = terminalreporter
        tr.write_sep("=", f"CPU seconds: {sum(self.cpu.values()):.0f} in all")
        for module, cpu in sorted(by_module.items(), key=lambda kv: -kv[1])[: n or None]:
            tr.write_line(f"{cpu:8.1f}  {module}")
        tr.write_sep("-", "by test")
        for nodeid, cpu in ranked[: n or None]:
            tr.write_line(f"{cpu:8.1f}  {nodeid}")


def pytest_configure(config):
    if config.getoption("cpu_durations") is not None:
        config.pluginmanager.register(Totals(), "cpu-durations")
