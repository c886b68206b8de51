"""The pytest plug-in behind ``glmport conformance`` (registered as a ``pytest11`` entry
point, so ``pytest --glmport-backend X`` works in any environment with glmport).

Options: ``--glmport-backend`` (default: the first ``--glmport-plugin``'s backend,
else ``GLMPORT_BACKEND``, else auto), ``--glmport-plugin module:attr`` (repeatable: a
backend registered in code, a ``Backend`` instance or a callable returning one,
registered in the controller and in every pytest-xdist worker before the suite runs),
``--glmport-emulate``, ``--glmport-full``, ``--glmport-ops a,b``,
``--glmport-mustpass VERSION`` (exactly that mustpass list's checks, of ``--glmport-ops``
when given; the run fails when one fails or is missing),
``--glmport-report-dir D`` (default ``conformance-report``). With pytest-xdist, the
workers run checks and the controller gathers their records, prints the summary and
writes the reports.

pytest loads this module in every run of every project in the environment, so at
module level it imports pytest only: glmport (and with it torch) is imported in the
hooks and fixtures, once a run collects the suite (``glmport_check``) or asks for
``glmport_settings``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

DEFAULT_REPORT_DIR = "conformance-report"


@dataclass(frozen=True)
class SuiteSettings:
    backend: str
    emulate: bool
    full: bool
    ops: tuple[str, ...] | None
    device: str
    mustpass: str | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("glmport", "glmport conformance suite")
    group.addoption(
        "--glmport-backend",
        default=None,
        help="backend to judge (default: the first --glmport-plugin's, else GLMPORT_BACKEND, "
        "else auto)",
    )
    group.addoption(
        "--glmport-plugin",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="register a backend defined in code (a Backend instance, or a callable "
        "returning one) in every process before the suite runs; repeatable",
    )
    group.addoption(
        "--glmport-emulate", action="store_true", help="run a vendor backend on the CPU"
    )
    group.addoption(
        "--glmport-full", action="store_true", help="full mode: the larger GLM-5 shapes too"
    )
    group.addoption(
        "--glmport-ops", default=None, help="comma-separated ops to check (default: all)"
    )
    group.addoption(
        "--glmport-mustpass",
        default=None,
        metavar="VERSION",
        help="run exactly this mustpass list's checks (of --glmport-ops when given); "
        "fail when one fails or is missing",
    )
    group.addoption(
        "--glmport-report-dir", default=DEFAULT_REPORT_DIR, help="where conformance.json/.md go"
    )


def _settings(config: pytest.Config) -> SuiteSettings:
    from glmport.conformance import mustpass
    from glmport.conformance.calls import device_for
    from glmport.core import environment
    from glmport.core.errors import ConfigError
    from glmport.core.registry import REGISTRY
    from glmport.core.selection import current_settings, primary_backend, use_backend

    ops = config.getoption("--glmport-ops")
    if ops:
        try:
            ops = environment.parse_op_names(ops, "--glmport-ops")
        except ConfigError as err:
            raise pytest.UsageError(str(err)) from None
    version = config.getoption("--glmport-mustpass")
    if version is not None:
        try:
            mustpass.load(version, "--glmport-mustpass")  # unknown: the known ones listed
        except ConfigError as err:
            raise pytest.UsageError(str(err)) from None
    full = config.getoption("--glmport-full")
    if version is not None and full:
        raise pytest.UsageError("--glmport-full: not with --glmport-mustpass (its list decides)")
    emulate = config.getoption("--glmport-emulate") or current_settings().emulate
    plugins = _register_plugins(config)
    backend = (
        config.getoption("--glmport-backend")
        or (plugins[0] if plugins else None)
        or environment.read("GLMPORT_BACKEND")  # "auto" when unset
    )
    if backend == "auto":
        with use_backend(emulate=emulate):
            backend = primary_backend()
    REGISTRY.get(backend)  # an unknown name fails here, listing the valid ones
    device = str(device_for(REGISTRY.get(backend).device_type(emulate)))
    return SuiteSettings(backend, emulate, full, ops or None, device, version)


def _register_plugins(config: pytest.Config) -> list[str]:
    """Register every ``--glmport-plugin`` backend in this process (once per target);
    returns their names."""
    targets = config.getoption("--glmport-plugin")
    if not targets:
        return []
    from glmport.core.errors import GlmportError
    from glmport.core.registry import register_backend_target

    try:
        return [register_backend_target(t) for t in targets]
    except GlmportError as err:
        raise pytest.UsageError(f"--glmport-plugin: {err}") from None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "glmport: a glmport conformance check")
    _register_plugins(config)  # in the controller and, with pytest-xdist, in every worker
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Collector(config), "glmport-conformance-collector")


@pytest.fixture(scope="session")
def glmport_settings(request: pytest.FixtureRequest) -> SuiteSettings:
    return _settings(request.config)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "glmport_check" not in metafunc.fixturenames:
        return
    from glmport.conformance.mustpass import load, select_checks
    from glmport.conformance.runner import suite_checks

    s = _settings(metafunc.config)
    if s.mustpass is None:
        checks = suite_checks(full=s.full, ops=s.ops)
    else:
        checks = select_checks(load(s.mustpass), s.ops)
    metafunc.parametrize("glmport_check", checks, ids=[c.id for c in checks])


class _Collector:
    """Lives on the controller: gathers records, reports at the end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.records: list[dict] = []
        self.report: dict | None = None

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" and not (report.when == "setup" and report.skipped):
            return
        for key, value in report.user_properties:
            if key == "glmport":
                self.records.append(value)

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        s = _settings(self.config)
        if not self.records and s.mustpass is None:
            return
        from glmport.conformance.html import write_reports
        from glmport.conformance.report import build_report

        self.report = build_report(
            self.records,
            backend=s.backend,
            full=s.full,
            emulate=s.emulate,
            ops=s.ops,
            mustpass=s.mustpass,
        )
        self.paths = write_reports(self.report, self.config.getoption("--glmport-report-dir"))
        # Failed checks fail the session already; this catches a backend none of whose
        # own checks passed (it implements nothing, or cannot run here): checks that
        # passed on fallbacks say nothing about it, so it never passes silently.
        if not self.report["verdict"]["run_ok"] and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        # A required check that is missing fails a mustpass run too (none may be lost).
        missed = s.mustpass is not None and not self.report["mustpass"]["met"]
        if missed and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.report is None:
            return
        from glmport.conformance.report import mustpass_line, table_lines, verdict_line

        tr = terminalreporter
        tr.section("glmport conformance")
        for line in table_lines(self.report):
            tr.write_line(line)
        tr.write_line("")
        ok = self.report["verdict"]["run_ok"]
        tr.write_line(verdict_line(self.report), bold=True, green=ok, red=not ok)
        result = self.report["mustpass"]
        if result:
            met = result["met"]
            tr.write_line(mustpass_line(self.report), bold=True, green=met, red=not met)
        if result and result["requested"]:  # a vendor's CI log: every check not passed, why
            from glmport.conformance.mustpass import not_passed_lines

            for line in not_passed_lines(result):
                tr.write_line(line)
        if self.report["summary"]["pass"] == 0:
            tr.write_line(
                f"none of {self.report['backend']!r}'s own kernels passed a check: does it "
                "implement the ops checked, and can it run here? (see the skip reasons)",
                red=True,
            )
        tr.write_line(f"reports: {', '.join(str(p) for p in self.paths)}")
