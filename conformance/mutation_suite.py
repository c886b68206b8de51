"""The mutant library as a pytest module: one test per mutant, so pytest-xdist runs
them in parallel (``glmport conformance --mutants`` drives it).

The run's plan (the base backend, emulation, mode and the mutant ids) reaches every
worker through the environment variable :data:`PLAN_VARIABLE`, JSON written by
:func:`plan_environment`. Each test records its :class:`~.mutation.MutantResult` as the
user property :data:`RESULT_PROPERTY`, which the controller gathers; a test fails only
for a broken mutant (the mutation's own code raised), never for a survivor: surviving
is a finding about the suite, reported with the kill rate.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import pytest

from glmport.conformance.mutants import LIBRARY
from glmport.conformance.mutation import run_mutant

# Internal to one run (the CLI sets it for its own pytest): not a GLMPORT_* setting.
PLAN_VARIABLE = "_GLMPORT_MUTATION_PLAN"
RESULT_PROPERTY = "glmport_mutant"


@dataclass(frozen=True)
class Plan:
    """What one ``--mutants`` run judges: ``ids`` (library ids) of ``base``'s mutants,
    ``emulate`` (True: vendor backends on the CPU), ``full`` (full-mode checks)."""

    base: str
    emulate: bool
    full: bool
    ids: tuple[str, ...]


def plan_environment(plan: Plan) -> dict[str, str]:
    """The environment entry that hands ``plan`` to the suite's processes."""
    return {PLAN_VARIABLE: json.dumps(asdict(plan))}


def read_plan() -> Plan:
    raw = os.environ.get(PLAN_VARIABLE)
    if raw is None:
        raise pytest.UsageError(
            f"{__name__} runs under 'glmport conformance --mutants' ({PLAN_VARIABLE} is unset)"
        )
    data = json.loads(raw)
    return Plan(data["base"], data["emulate"], data["full"], tuple(data["ids"]))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "mutant_id" in metafunc.fixturenames:
        ids = read_plan().ids
        metafunc.parametrize("mutant_id", ids, ids=ids)


def test_mutant(mutant_id: str, record_property) -> None:
    plan = read_plan()
    emulate = True if plan.emulate else None
    result = run_mutant(LIBRARY[mutant_id], plan.base, emulate=emulate, full=plan.full)
    record_property(RESULT_PROPERTY, result.to_dict())
    if result.status == "broken":
        pytest.fail(f"the mutant's own code raised: {result.broken_by}", pytrace=False)


class _Gatherer:
    """A plug-in of the controller: gathers each mutant's result as its test reports,
    and shows the run's progress (rich, on stderr)."""

    def __init__(self, total: int, progress) -> None:
        self.results: list[dict] = []
        self.progress, self.total = progress, total
        self.task = progress.add_task("mutants", total=total) if progress else None

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        for key, value in report.user_properties:
            if key == RESULT_PROPERTY:
                self.results.append(value)
                self._show(value)

    def _show(self, result: dict) -> None:
        if self.progress is None:
            return
        done = len(self.results)
        killed = sum(r["status"] == "killed" for r in self.results)
        tally = f"{killed} killed, {done - killed} not"
        self.progress.update(self.task, advance=1, description=tally)
        console = self.progress.console
        if result["status"] != "killed":
            console.print(
                f"{result['status']}: {result['id']} (needs {result['needs']})", markup=False
            )
        if not console.is_terminal and (done % 20 == 0 or done == self.total):
            console.print(f"{done}/{self.total} mutants: {tally}", markup=False)  # a log: no bar


def run_suite(
    plan: Plan, workers: str, *, plugins: Iterable[str] = (), show_progress: bool = True
) -> list[dict]:
    """Run ``plan``'s mutants under pytest with ``workers`` pytest-xdist workers
    (``"0"``: in this process), each ``plugins`` target (``module:attr``, as
    ``--glmport-plugin`` takes it) registered in every process; the
    :class:`~.mutation.MutantResult` dicts of every mutant. Raises
    :class:`~glmport.core.errors.GlmportError` when pytest could not run them all (a
    collection or internal error)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from glmport.core.errors import GlmportError

    args = [__file__, "-c", os.devnull, "--rootdir", os.getcwd(), "-p", "no:cacheprovider"]
    args += ["-p", "no:terminal", "-n", workers]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        args += ["-p", "pytest_glmport", "-p", "xdist.plugin"]
    for target in plugins:
        args += ["--glmport-plugin", target]
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    progress = (
        Progress(*columns, console=Console(stderr=True, soft_wrap=True)) if show_progress else None
    )
    gatherer = _Gatherer(len(plan.ids), progress)
    saved = os.environ.get(PLAN_VARIABLE)
    os.environ.update(plan_environment(plan))
    try:
        if progress:
            progress.start()
        exit_code = pytest.main(args, plugins=[gatherer])
    finally:
        if progress:
            progress.stop()
        if saved is None:
            os.environ.pop(PLAN_VARIABLE, None)
        else:
            os.environ[PLAN_VARIABLE] = saved
    missing = set(plan.ids) - {r["id"] for r in gatherer.results}
    if missing or exit_code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        shown = ", ".join(sorted(missing)[:5]) + (" ..." if len(missing) > 5 else "")
        raise GlmportError(
            f"--mutants: pytest ended with {pytest.ExitCode(exit_code).name}"
            + (f" and no result for {len(missing)} mutant(s): {shown}" if missing else "")
        )
    return gatherer.results
