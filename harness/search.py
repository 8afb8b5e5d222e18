"""`search.optuna`: the runs of a sweep chosen one by one by Optuna's TPE sampler instead of a grid.

The executor takes its runs from this source (`harness.executor.RunSource`): whenever a host is free
and no run waits, `next` asks the study for a trial and turns its values into an ordinary run (its own
run folder, manifest and a run id that says its values); when a run ends, `ended` tells the study the
run's objective, or that it failed (a failed run is never told as a value: TPE leaves it out). So as
many trials are in flight as there are free hosts, each told as it ends; TPE's constant liar keeps two
trials in flight from being the same point.

The study lives in the sweep folder as SQLite (`SweepLayout.study`), so `harness sweep --resume`
continues it: trials already told are not run again; a trial whose run was in flight when the sweep
stopped keeps its number and its point and is run again (the executor's resume stops what is left of
it on its host); a trial whose run had ended, but was not told before the orchestrator died, is told
from its run folder. The search asks no more trials once `budget` runs have been asked, once every
point of a finite space has run, or once `patience` runs in a row have not beaten the best. A point
the sampler proposes again is not run again: its trial is told the earlier run's result and marked a
duplicate (it costs no run). search.json, rewritten as trials end, is what compare and the report read
(they never load Optuna).

Only this module imports Optuna, and only a sweep with `search.optuna` imports this module, so the
commands that do not search start as fast as before.
"""

from __future__ import annotations

import datetime as dt
import inspect
import logging
import re
import threading
from pathlib import Path
from typing import Any, Literal

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    check_distribution_compatibility,
)
from optuna.trial import FrozenTrial, TrialState

from harness.config.playbook import Optuna
from harness.config.space import Entry, Range, check, size
from harness.errors import InputError
from harness.journal import FINAL, latest_states
from harness.plan import RunSpec, Sweep, search_run
from harness.results import (
    RunManifest,
    SearchFile,
    SearchTrial,
    SweepLayout,
    Unreadable,
    load_run,
    write_model,
)

RUN_ID = "run_id"
DUPLICATE_OF = "duplicate_of"
REASON = "reason."
"""A study attribute per failed trial (`reason.7`): why it has no value, kept for search.json once its
run folder holds the run again (--retry-failed), which said nothing of the failure."""
FIXED = ("objective", "direction", "level")
"""Settings a resumed study must keep: its values so far would mean something else."""
MAX_DUPLICATES = 50
"""Proposals in a row of points already run after which the search ends (the space is as good as done)."""
LATENCY = re.compile(r"^(ttft|itl|tpot|e2e)_ms_(\w+)$")
(OPTUNA_RANDOM_STATE,) = inspect.signature(optuna.samplers.RandomSampler).parameters
"""The keyword under which Optuna's samplers take their random state (the playbook's `random_state`):
RandomSampler takes nothing else, so its one parameter is it. The harness keeps its own name for it
throughout; this is where that name meets Optuna's."""


def distribution(entry: Entry) -> BaseDistribution:
    """The Optuna distribution of one space entry."""
    if isinstance(entry, list):
        return CategoricalDistribution(entry)
    if entry.integers:
        return IntDistribution(int(entry.low), int(entry.high), log=entry.log, step=int(entry.step or 1))
    return FloatDistribution(float(entry.low), float(entry.high), log=entry.log,
                             step=float(entry.step) if entry.step else None)


def point_of(settings: Optuna, params: dict[str, Any]) -> dict[str, Any]:
    """A trial's values as its run uses them (a float of a range without a step, to 4 digits), in the
    space's order; a path the space no longer has (a resumed, edited playbook) keeps its value."""
    ordered = [p for p in settings.space if p in params] + [p for p in params if p not in settings.space]
    out = {}
    for path in ordered:
        entry = settings.space.get(path)
        out[path] = entry.value(params[path]) if isinstance(entry, Range) else params[path]
    return out


def objective_of(manifest: RunManifest, layout: SweepLayout, settings: Optuna) -> tuple[float | None, str | None]:
    """The run's objective at the search's level, or None and why there is none."""
    if not manifest.ok:
        return None, manifest.error.line() if manifest.error else f"the run is {manifest.status}"
    try:
        run = load_run(layout.run(manifest.run_id))
    except Unreadable as e:
        return None, str(e)
    levels = [lv for lv in run.levels if lv.concurrency is not None and not lv.probe]
    if not levels:
        return None, "the run has no closed-loop benchmark level (the objective is read at a concurrency)"
    want = settings.level or max(lv.concurrency for lv in levels if lv.concurrency is not None)
    level = next((lv for lv in levels if lv.concurrency == want), None)
    if level is None:
        measured = ", ".join(str(lv.concurrency) for lv in levels)
        return None, f"the run measured no concurrency {want} (levels: {measured})"
    m = LATENCY.match(settings.objective)
    value = level.stat(m.group(1) + "_ms", m.group(2)) if m else getattr(level, settings.objective)
    if value is None:
        return None, f"{settings.objective} was not measured at concurrency {want}"
    return float(value), None


class Search:
    """The executor's source of runs for `search.optuna` (see the module's docstring)."""

    def __init__(self, sweep: Sweep, results: Path, *, resume: bool = False):
        settings = sweep.playbook.optuna
        assert settings is not None  # only a searching playbook makes one
        check(sweep)   # trials that could never have a value: refused before the study or a host
        self.sweep, self.settings = sweep, settings
        self.layout = SweepLayout.of(results, sweep.sweep_id)
        self.total = settings.budget
        self.lock = threading.Lock()
        self.distributions = {path: distribution(e) for path, e in settings.space.items()}
        self.grid_size = size(settings.space)
        self.trial_of: dict[str, int] = {}        # run id -> the number of the trial that made it
        self.stopped: str | None = None           # why no more trials are asked
        self.broken: str | None = None            # the study itself failed
        self.best: float | None = None            # the best value so far (search.json's best)
        self.interrupted = False                  # the sweep was: its trials in flight were stopped
        self.resume = resume
        self._study: optuna.Study | None = None
        self._settled = not resume
        self._told: set[tuple[str, float | None]] = set()   # (run id, its start): each run told once
        optuna.logging.set_verbosity(logging.WARNING)   # the live display says what happens, not Optuna's log
        if resume and self.layout.study.exists():
            self._load()

    # --- the study --------------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why the search failed, which the sweep says at its end (exit 1): its study failed, or it
        ended with no trial valued, so it found nothing (every run failed, or none measured the
        objective) though each run that failed said so, and a run that went well but measured
        nothing said nothing."""
        if self.broken or not self.stopped or self.best is not None:
            return self.broken
        return (f"the search found no value of {self.settings.objective}: every trial failed "
                f"({self.layout.search} says why each did)")

    @property
    def direction(self) -> Literal["maximize", "minimize"]:
        return "maximize" if self.settings.maximize else "minimize"

    def _open(self) -> optuna.Study:
        if self._study is None:
            self.layout.dir.mkdir(parents=True, exist_ok=True)
            random_state: dict[str, Any] = {OPTUNA_RANDOM_STATE: self.settings.random_state}
            sampler = optuna.samplers.TPESampler(n_startup_trials=self.settings.startup_trials, **random_state)
            self._study = optuna.create_study(storage=f"sqlite:///{self.layout.study}",
                                              study_name=self.sweep.sweep_id, direction=self.direction,
                                              sampler=sampler, load_if_exists=True)
            fixed = {"objective": self.settings.objective, "direction": self.direction,
                     "level": self.settings.level}
            before = self._study.user_attrs
            changed = [k for k in FIXED if k in before and before[k] != fixed[k]]
            if changed:
                raise InputError(f"the search's {', '.join(changed)} changed since its study began "
                                 f"({'; '.join(f'{k}: {before[k]} -> {fixed[k]}' for k in changed)}): its "
                                 "trials' values would mean something else; start a new sweep",
                                 file=str(self.sweep.doc.path), key="search.optuna." + changed[0],
                                 line=self.sweep.doc.line(("search", "optuna", changed[0])))
            self._same_space(self._study)
            for key, value in fixed.items():
                self._study.set_user_attr(key, value)
        return self._study

    def _same_space(self, study: optuna.Study) -> None:
        """A resumed study's space must be one Optuna can go on with: the same choices of a list, a
        range still a range of the same kind (its bounds may move). Otherwise the first trial asked
        failed as the study's own fault, after the runs left over had run."""
        for trial in study.get_trials(deepcopy=False):
            for path, before in trial.distributions.items():
                now = self.distributions.get(path)
                try:
                    if now is not None:
                        check_distribution_compatibility(before, now)
                except ValueError:
                    was = (", ".join(map(str, before.choices)) if isinstance(before, CategoricalDistribution)
                           else f"a {'log ' if getattr(before, 'log', False) else ''}range")
                    where = ("search", "optuna", "space", path)
                    raise InputError(f"changed since its study began (it was {was}): Optuna cannot go on with a "
                                     "study whose choices changed; put them back, or start a new sweep",
                                     file=str(self.sweep.doc.path), key=".".join(where),
                                     line=self.sweep.doc.line(where)) from None

    def _load(self) -> None:
        """A resumed sweep's runs so far, from its study (read before the sweep is locked: reads only)."""
        study = self._open()
        for trial in study.get_trials(deepcopy=False):
            run_id = trial.user_attrs.get(RUN_ID)
            if run_id is None or DUPLICATE_OF in trial.user_attrs or trial.state == TrialState.WAITING:
                continue
            spec = self._spec(point_of(self.settings, trial.params))
            self.trial_of[spec.run_id] = trial.number
            if all(s.run_id != spec.run_id for s in self.sweep.runs):
                self.sweep.runs.append(spec)

    def _settle(self, study: optuna.Study) -> None:
        """Once, on resume: a trial still running whose run ended before the orchestrator died is told now
        (one that never became a run is failed: nothing would ever tell it)."""
        self._settled = True
        states = latest_states(self.layout.journal)
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            run_id = trial.user_attrs.get(RUN_ID)
            if run_id is None:   # asked, and the orchestrator died before it became a run: none to wait for
                study.tell(trial.number, state=TrialState.FAIL)
            elif run_id in states and states[run_id].state in FINAL:
                try:
                    manifest = load_run(self.layout.run(run_id)).manifest
                except Unreadable:
                    continue   # the executor runs it again, and it is told then
                self._tell(study, trial.number, manifest)

    # --- the executor's source ---------------------------------------------------------------------

    def next(self) -> RunSpec | None:
        with self.lock:
            if self.stopped:
                return None
            try:
                return self._next()
            except InputError as e:   # a changed objective on resume, named with its key
                self.stopped = self.broken = str(e)
            except Exception as e:  # the study's database failed us: no more trials, the runs in flight end
                self.stopped = self.broken = f"the study in {self.layout.study} failed: {type(e).__name__}: {e}"
            return None

    def _next(self) -> RunSpec | None:
        study = self._open()
        if not self._settled:
            self._settle(study)
        for _ in range(MAX_DUPLICATES):
            if (why := self._why_stop(study)) is not None:
                self.stopped = why
                self._write(study)
                return None
            trial = study.ask(self.distributions)
            spec = self._spec(point_of(self.settings, trial.params))
            trial.set_user_attr(RUN_ID, spec.run_id)
            earlier = self.trial_of.get(spec.run_id)
            if earlier is None:
                self.trial_of[spec.run_id] = trial.number
                self._write(study)
                return spec
            trial.set_user_attr(DUPLICATE_OF, earlier)
            done = study.get_trials(deepcopy=False)[earlier]
            if done.state == TrialState.COMPLETE:
                study.tell(trial, done.value)
            else:   # failed, or still running: no value to repeat
                study.tell(trial, state=TrialState.FAIL)
        self.stopped = f"the sampler proposed only points already run ({MAX_DUPLICATES} in a row)"
        self._write(study)
        return None

    def close(self, *, interrupted: bool) -> None:
        """The sweep is over. Interrupted, its trials in flight stay running in the study (told on
        `--resume`) and search.json says they were interrupted, not that they still run."""
        if not interrupted:
            return
        with self.lock:
            self.interrupted = True
            if self._study is not None:
                try:
                    self._write(self._study)
                except Exception as e:  # the runs' results stand; said at the sweep's end
                    self.broken = f"the study in {self.layout.study} failed: {type(e).__name__}: {e}"

    def ended(self, manifest: RunManifest) -> None:
        with self.lock:
            number = self.trial_of.get(manifest.run_id)
            if number is None or manifest.status == "skipped":
                return
            try:
                study = self._open()
                if not self._settled:
                    self._settle(study)
                self._tell(study, number, manifest)
                self._write(study)
            except Exception as e:  # the run's results stand; the trial stays running, told on --resume
                self.stopped = self.broken = f"the study in {self.layout.study} failed: {type(e).__name__}: {e}"

    def _tell(self, study: optuna.Study, number: int, manifest: RunManifest) -> None:
        told = (manifest.run_id, manifest.started)
        if told in self._told:   # the resume's settling read this run's manifest before the executor told it
            return
        self._told.add(told)
        value, why = objective_of(manifest, self.layout, self.settings)
        trial = study.get_trials(deepcopy=False)[number]
        if trial.state == TrialState.RUNNING:
            if value is None:
                study.set_user_attr(f"{REASON}{number}", why)
                study.tell(number, state=TrialState.FAIL)
            else:
                study.tell(number, value)
            return
        # told before: a failed run that --resume --retry-failed ran again is a new trial of its point
        retried = optuna.trial.create_trial(
            state=TrialState.COMPLETE if value is not None else TrialState.FAIL, value=value,
            params=trial.params, distributions=trial.distributions, user_attrs={RUN_ID: manifest.run_id})
        study.add_trial(retried)
        self.trial_of[manifest.run_id] = study.get_trials(deepcopy=False)[-1].number
        if value is None:
            study.set_user_attr(f"{REASON}{self.trial_of[manifest.run_id]}", why)

    def done(self) -> str | None:
        """Why this search, resumed, would ask no new trial (its budget spent, every point run, its
        patience out), from its study as it is; None when it would ask more. What `--resume --dry-run`
        says after the runs left over."""
        with self.lock:
            return self._why_stop(self._open()) if self.layout.study.exists() else None

    def _why_stop(self, study: optuna.Study) -> str | None:
        budget, patience = self.settings.budget, self.settings.patience
        if len(self.trial_of) >= budget:
            return f"the budget of {budget} runs is spent"
        if self.grid_size is not None and len(self.trial_of) >= self.grid_size:
            return f"every point of the space ({self.grid_size}) has run"
        if patience is not None:
            since = self._since_best(study)
            if since >= patience:
                return f"{since} runs in a row did not beat the best (patience {patience})"
        return None

    def _since_best(self, study: optuna.Study) -> int:
        """Finished runs since the last one that beat the best (a failed run beats nothing)."""
        ended = sorted((t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
                        if DUPLICATE_OF not in t.user_attrs),
                       key=lambda t: t.datetime_complete or dt.datetime.min)
        best: float | None = None
        since = 0
        for t in ended:
            if t.state == TrialState.COMPLETE and t.value is not None and (
                    best is None or (t.value > best if self.settings.maximize else t.value < best)):
                best, since = t.value, 0
            else:
                since += 1
        return since

    # --- runs and the results file -----------------------------------------------------------------

    def _spec(self, point: dict[str, Any]) -> RunSpec:
        return search_run(self.sweep, point)

    def _write(self, study: optuna.Study) -> None:
        reasons = {int(k.removeprefix(REASON)): v for k, v in study.user_attrs.items() if k.startswith(REASON)}
        found = search_file(study.get_trials(deepcopy=False), self.settings, self.layout, grid_size=self.grid_size,
                            stopped=self.stopped, reasons=reasons, interrupted=self.interrupted)
        self.best = found.best.value if found.best is not None else None
        write_model(self.layout.search, found)


def search_file(trials: list[FrozenTrial], settings: Optuna, layout: SweepLayout, *, grid_size: int | None,
                stopped: str | None, reasons: dict[int, str] | None = None, interrupted: bool = False) -> SearchFile:
    """search.json from the study's trials: each with its run, state and value, and the best. After an
    interrupt a trial still running in the study is `interrupted` (the study keeps it running, to be
    told on `--resume`)."""
    states = {TrialState.COMPLETE: "complete", TrialState.FAIL: "failed",
              TrialState.RUNNING: "interrupted" if interrupted else "running"}
    out = []
    for t in trials:
        run_id = t.user_attrs.get(RUN_ID)
        if run_id is None or t.state not in states:
            continue
        state = "duplicate" if DUPLICATE_OF in t.user_attrs else states[t.state]
        reason = (reasons or {}).get(t.number)
        if state == "failed" and reason is None:   # a study of an older harness: the run folder says why
            try:
                _, reason = objective_of(load_run(layout.run(run_id)).manifest, layout, settings)
            except Unreadable:
                reason = "the run left no manifest"
        out.append(SearchTrial(number=t.number, run_id=run_id, config=run_id.removesuffix("-1"), state=state,
                               value=t.value if t.state == TrialState.COMPLETE else None,
                               params=point_of(settings, t.params), duplicate_of=t.user_attrs.get(DUPLICATE_OF),
                               reason=reason))
    valued = [t for t in out if t.state == "complete" and t.value is not None]
    best = (max if settings.maximize else min)(valued, key=lambda t: t.value or 0.0) if valued else None
    return SearchFile(objective=settings.objective, direction="maximize" if settings.maximize else "minimize",
                      level=settings.level, budget=settings.budget, patience=settings.patience,
                      random_state=settings.random_state, grid_size=grid_size,
                      space={p: e if isinstance(e, list) else e.model_dump(exclude_defaults=True)
                             for p, e in settings.space.items()},
                      runs=len({t.run_id for t in out if t.state != "duplicate"}), trials=out, best=best,
                      stopped=stopped)
