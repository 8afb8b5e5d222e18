"""`harness reproduce RUN_DIR`: run a recorded run again from its directory alone, and say what differs.

A run directory carries its resolved one-configuration playbook and every launch template it was
rendered from (manifest.json `playbook` and `template.files`). Reproducing writes those beside the new
results (`RESULTS/.reproduce/<run_id>-<time>/`), runs them as a new sweep on the chosen host, and puts
the two runs side by side: host facts that differ, and every metric with its delta and whether that
delta is beyond the run-to-run noise (the spread of the original's repeats when it had some). A level
pairs with the one of the same key in the other run (`level_key`: scenario, load kind, load, and whether
it is a probe of max_load), never by concurrency alone: open-loop levels have none, and two scenarios
may share one.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as dt
import difflib
import os
import re
import shlex
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from harness.errors import InputError
from harness.plan import Sweep, load_sweep
from harness.remote.stats import percentile
from harness.results import (
    BenchLevel,
    HostRunLayout,
    RunLayout,
    RunManifest,
    RunResult,
    Unreadable,
    read_model,
    read_requests,
    samples,
)
from harness.results import load_run as load_run_result
from harness.results.models import SAFE_NAME
from harness.secrets import MASK, arg_env_name

METRICS = [("ttft_ms", "p50", "TTFT p50 ms"), ("itl_ms", "p50", "ITL p50 ms"), ("itl_ms", "p99", "ITL p99 ms"),
           ("tpot_ms", "p50", "TPOT p50 ms"), ("output_tok_s", None, "tok/s")]
FACTS = ("gpus", "cuda", "engine_version", "engine_git", "python", "kernel", "env")
DEFAULT_NOISE = 0.05   # relative band assumed when neither repeats nor requests can tell
MIN_NOISE = 0.02


def load_run(run_dir: Path) -> RunManifest:
    """The run's manifest, checked for what reproducing needs: the resolved playbook and every template."""
    layout = RunLayout(Path(run_dir))
    if not layout.manifest.exists():
        raise InputError(f"not a run directory (no {layout.manifest.name})", file=str(run_dir))
    manifest = read_model(layout.manifest, RunManifest)
    template = manifest.template or {}
    if not isinstance(manifest.playbook, dict) or not isinstance(template.get("files"), dict):
        missing = "playbook" if not isinstance(manifest.playbook, dict) else "template"
        if manifest.status == "skipped" or (not manifest.ok and not manifest.phases):   # `unrun_manifest`'s
            why = manifest.skipped or (manifest.error.message if manifest.error else None) or "no reason recorded"
            raise InputError(f"the run never started ({manifest.status}: {why}): its folder records nothing "
                             "to run again; run its sweep's playbook instead", file=str(layout.manifest),
                             key="status")
        raise InputError(f"the manifest has no `{missing}` record: it was written by an older harness and "
                         "cannot be reproduced from the directory alone", file=str(layout.manifest))
    # a run directory may come from anyone: its names must not lead a write out of the results folder
    if not SAFE_NAME.match(manifest.run_id):
        raise InputError(f"run_id {manifest.run_id!r} is not a plain name", file=str(layout.manifest), key="run_id")
    for name in [template.get("name"), *template["files"]]:
        if not isinstance(name, str) or not TEMPLATE_NAME.match(name):
            raise InputError(f"template file name {name!r} is not a plain file name", file=str(layout.manifest),
                             key="template.files")
    if not all(isinstance(text, str) for text in template["files"].values()):
        raise InputError("a template's text is not text", file=str(layout.manifest), key="template.files")
    return manifest


TEMPLATE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*\.j2$")


WORKSPACE = ".reproduce"
"""Beside the results: each reproduction's copy of the recorded playbook and templates, in a folder
of its own (`<run_id>-<time>`), which the reproduction's sweep.json names as its playbook."""
PARTIAL_STALE_S = 600
"""A folder still being written (`.<run_id>-*.partial`) lives for the milliseconds its few files
take; one this old was left by a reproduction killed outright (kill -9), and the next one removes it."""


@contextlib.contextmanager
def reproduction(run_dir: Path, inventory: Path, *, host: str | None, results: Path,
                 model_path: str | None = None) -> Iterator[Sweep]:
    """The sweep that reproduces `run_dir` (`prepare`), for the time it is set up and run. What goes
    wrong before the reproduction's sweep folder exists (a refusal, a Slurm allocation that does not
    come, Ctrl-C) leaves nothing new on disk: its working folder, and the results folders that were
    made for it, go. Once the sweep has begun, its folder is a record like any sweep's and stays."""
    made = _missing_dirs(Path(results) / WORKSPACE)
    sweep = prepare(run_dir, inventory, host=host, results=results, model_path=model_path)
    try:
        yield sweep
    except BaseException:
        if not (Path(results) / sweep.sweep_id).exists():
            _undo(sweep.doc.path.parent, made)
        raise


def prepare(run_dir: Path, inventory: Path, *, host: str | None, results: Path,
            model_path: str | None = None) -> Sweep:
    """Write the recorded playbook and templates beside the results and load them as a new sweep.

    The playbook written is the record as it is, secrets masked: the secrets taken from the environment
    reach the loaded sweep from memory only (`_load_filled`), never a file of the results. `model_path`
    replaces the recorded `model.path` (the model where it lives on this host); nothing else changes.

    The folder is written under a temporary name and renamed once whole, under a name no earlier
    reproduction has (nor its sweep): a folder cut short by Ctrl-C or a kill is never taken for a good
    one. A refusal, or anything else that stops it, leaves nothing behind, the folders it made included."""
    manifest = load_run(run_dir)
    record = str(RunLayout(Path(run_dir)).manifest)
    recorded = copy.deepcopy(manifest.playbook or {})
    if isinstance(recorded.get("search"), dict) and recorded["search"].get("optuna") is not None:
        recorded = recorded | {"search": None}   # an older record of a trial: the trial's own config is its run
    try:
        if not isinstance(recorded["name"], str):
            raise TypeError(f"name is {recorded['name']!r}")
        if model_path is not None:
            recorded["model"] = _moved_model(recorded["model"], model_path)
        target = host or recorded["hosts"]
        playbook, filled = fill_secrets(recorded, record)
    except (KeyError, TypeError, AttributeError) as e:
        raise InputError(f"the recorded playbook is not one a harness wrote ({type(e).__name__}: {e})",
                         file=record, key="playbook") from None
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    workspace = Path(results) / WORKSPACE
    made = _missing_dirs(workspace)
    where: Path | None = None
    try:
        workspace.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(workspace)
        partial = Path(tempfile.mkdtemp(prefix=f".{manifest.run_id}-", suffix=".partial", dir=workspace))
        where = partial
        template = manifest.template or {}
        for name, text in template["files"].items():
            (partial / name).write_text(text)
        where, suffix = _claim(partial, Path(results), f"{manifest.run_id}-{stamp}",
                               f"{reproduce_name(recorded)}-{stamp}")
        sweep_id = f"{reproduce_name(recorded)}-{stamp}{suffix}"
        placed = {"hosts": target, "template": str(where / template["name"]), "name": reproduce_name(recorded)}
        path = where / "playbook.yaml"
        path.write_text(yaml.safe_dump(recorded | placed, sort_keys=False))
        try:
            if filled:
                sweep = _load_filled(yaml.safe_dump(playbook | placed, sort_keys=False), path, inventory, sweep_id)
            else:
                sweep = load_sweep(path, inventory, sweep_id=sweep_id)
        except InputError as e:
            raise _as_recorded(e, where, record, host, inventory) from None
        if len(sweep.runs) != 1:
            raise InputError(f"the recorded playbook makes {len(sweep.runs)} runs, not the one a harness records",
                             file=record, key="playbook")
        return fewest_slots(sweep)
    except BaseException:
        _undo(where, made)
        raise


def _remove_stale_partials(workspace: Path) -> None:
    """The half-written folders that reproductions killed outright left (never one still being written)."""
    stale = time.time() - PARTIAL_STALE_S
    for folder in workspace.glob(".*.partial"):
        with contextlib.suppress(OSError):
            if folder.is_dir() and not folder.is_symlink() and folder.stat().st_mtime < stale:
                shutil.rmtree(folder)


def _moved_model(model: dict, path: str) -> dict:
    """The recorded `model` with its path replaced: a path on a host is text of one line."""
    if not path.strip() or any(c in path for c in "\0\n\r"):
        raise InputError(f"{path!r} is not a path on a host (empty, or more than one line)", key="--model-path")
    return model | {"path": path}


def _bare(e: InputError) -> str:
    """An InputError's message without the file, line and key it starts with."""
    where = str(InputError("", file=e.file, key=e.key, line=e.line))
    text = str(e)
    return text[len(where):] if where and text.startswith(where) else text


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first: what making it would make."""
    missing = []
    for p in (path, *path.parents):
        if p.exists():
            break
        missing.append(p)
    return missing


def _undo(folder: Path | None, made: list[Path]) -> None:
    """Remove a reproduction's working folder and the folders made for it, where nothing else came in."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    for p in made:
        with contextlib.suppress(OSError):
            p.rmdir()   # only an empty one: another command may have written beside it meanwhile


def _claim(partial: Path, results: Path, name: str, sweep_id: str) -> tuple[Path, str]:
    """Rename the finished `partial` folder to `name` (or `name-2`, `-3`... where that folder, or a sweep
    of `sweep_id` with that suffix, exists already: two reproductions in one second), and the suffix."""
    for n in range(1, 1000):
        suffix = "" if n == 1 else f"-{n}"
        final = partial.parent / f"{name}{suffix}"
        if final.exists() or (results / f"{sweep_id}{suffix}").exists():
            continue
        try:
            os.rename(partial, final)   # refused onto a folder that came meanwhile (holding anything)
        except OSError:
            if not final.exists():
                raise
            continue
        return final, suffix
    raise InputError(f"too many reproductions of {name} in {partial.parent}", file=str(partial.parent))


def _as_recorded(e: InputError, where: Path, record: str, host: str | None, inventory: Path) -> InputError:
    """An error of loading the copy, named where the user can find it: the run's manifest.json and the
    key of its record (`playbook.configs.0.nodes`, `template.files.NAME`), since the copy is removed."""
    if e.key == "hosts":
        if host is None:   # the original's hosts, named in a colleague's inventory or not
            return InputError(f"{_bare(e)}; choose a host of this inventory with --host NAME", file=record,
                              key="playbook.hosts")
        # the host asked for: named as the user gave it, not as the copy's playbook says
        return InputError(f"{host!r} matches no host of {inventory}", key="--host")
    file = Path(e.file) if e.file else None
    if file is None or file.parent != where:
        return e   # the inventory's own error: as it came
    message = _bare(e).replace(f"{where}/", "").replace(str(where), WORKSPACE)
    if file.name != "playbook.yaml":
        key = f"template.files.{file.name}"
        message = f"line {e.line}: {message}" if e.line else message
    elif e.key == "template":   # the copy's own key: the record names its template in the manifest
        key = "template.name"
    else:
        key = f"playbook.{e.key}" if e.key else "playbook"
    if e.key and e.key.endswith("nodes") and host is not None:
        message += "; give --host a group or several hosts (a,b) that can hold every node"
    return InputError(message, file=record, key=key)


def fewest_slots(sweep: Sweep) -> Sweep:
    """The sweep with each Slurm group cut to the nodes its one run spans, so that the allocation
    asks for those and no more (a group of 8 nodes reproducing a run on one holds one)."""
    (run,) = sweep.runs
    kept: dict[str | None, int] = {}
    hosts = []
    for h in sweep.hosts:
        if h.slurm is None or kept.setdefault(h.cluster, 0) < run.nodes:
            hosts.append(h)
            if h.slurm is not None:
                kept[h.cluster] += 1
    names = {h.name for h in hosts}
    return dataclasses.replace(sweep, hosts=hosts,
                               runs=[dataclasses.replace(run, hosts=tuple(h for h in run.hosts if h.name in names))])


def reproduce_name(playbook: dict) -> str:
    """The reproduction's own playbook name: a sweep of the original's name would be what
    `harness sweep ORIGINAL --resume` continues, were it the latest in the results folder."""
    name = str(playbook.get("name"))
    return name if name.endswith("-reproduce") else f"{name}-reproduce"


def _load_filled(text: str, record: Path, inventory: Path, sweep_id: str) -> Sweep:
    """The sweep of a playbook holding secrets, read from a file in memory (an anonymous one where
    the system has them, else a private file removed at once), its errors naming `record`, the same
    playbook with the secrets masked."""
    memfd = getattr(os, "memfd_create", None)
    with contextlib.ExitStack() as stack:
        if memfd is not None:
            fd = memfd("playbook.yaml", os.MFD_CLOEXEC)
            stack.callback(os.close, fd)
            source = f"/proc/self/fd/{fd}"
        else:
            handle = stack.enter_context(tempfile.NamedTemporaryFile("w", dir=record.parent, suffix=".yaml"))
            fd, source = handle.fileno(), handle.name
        os.write(fd, text.encode())   # one write: a regular file or a memfd takes it whole
        try:
            sweep = load_sweep(source, inventory, sweep_id=sweep_id)
        except InputError as e:
            file = str(record) if e.file == source else e.file   # a template's error names the template
            raise InputError(_bare(e).replace(source, str(record)), file=file, key=e.key, line=e.line) from None
    sweep.doc.path = record
    return sweep


def fill_secrets(playbook: dict, record: str) -> tuple[dict, bool]:
    """The recorded playbook with each masked secret taken from the environment (env values by their
    name, a secret flag's by the variables the launch script read it from), and whether any was; every
    one missing is named in one error, so that a colleague sets them all at once."""
    if inside := list(_masked_inside(playbook)):
        raise InputError(f"{', '.join(inside)} held a secret's value inside a longer one, which the record masks "
                         "(***): the value the run had is not in its folder, and a reproduction would launch "
                         "another server", file=record, key=inside[0])
    filled = copy.deepcopy(playbook)
    missing: dict[str, str] = {}   # environment variable -> the key of the record it fills
    for section in (filled["server"], *filled["configs"]):
        section["env"] = {k: _secret(k, v, missing) for k, v in (section.get("env") or {}).items()}
        section["args"] = {k: _secret_flag(k, v, missing) for k, v in (section.get("args") or {}).items()}
    if missing:
        names = list(missing)
        raise InputError(f"the recorded run used secrets that its record masks; set {' and '.join(names)} in "
                         "the environment to reproduce (" + "; ".join(f"{n} for {k}" for n, k in missing.items())
                         + ")", file=record, key=", ".join(dict.fromkeys(missing.values())))
    return filled, filled != playbook


def _masked_inside(playbook: dict) -> Iterator[str]:
    """The keys of what launches the server (model, server, configs) whose recorded text had a secret's
    value masked inside it (`https://***@hub`), or masked whole where no secret is asked for: what
    `fill_secrets` cannot fill from the environment. The benchmark is left out: a prompt may say ***."""
    def walk(value: Any, where: tuple) -> Iterator[str]:
        if isinstance(value, dict):
            for k, v in value.items():
                yield from walk(v, (*where, k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                yield from walk(v, (*where, i))
        elif isinstance(value, str) and MASK in value:
            secret_slot = value == MASK and any(w in ("env", "args") for w in where[1:3])
            if not secret_slot:
                yield ".".join(map(str, where))
    for section in ("model", "server", "configs"):
        yield from walk(playbook.get(section), (section,))


def _secret(name: str, value: str, missing: dict[str, str]) -> str:
    if value != MASK:
        return value
    if name not in os.environ:
        missing.setdefault(name, f"env.{name}")
        return value
    return os.environ[name]


def _secret_flag(flag: str, value: Any, missing: dict[str, str]) -> Any:
    """A secret flag's recorded value (each word ***) taken from the environment variables the launch
    script read it from: HARNESS_ARG_API_KEY, then HARNESS_ARG_API_KEY_1... for several values."""
    names: list[str] = []

    def fill(item: Any) -> Any:
        if isinstance(item, list):
            return [fill(v) for v in item]
        if item != MASK:
            return item
        names.append(f"{arg_env_name(flag)}_{len(names)}" if names else arg_env_name(flag))
        if names[-1] not in os.environ:
            missing.setdefault(names[-1], f"args.{flag}")
            return item
        return os.environ[names[-1]]
    return fill(value)


LevelKey = tuple[str | None, str, float | None, bool]
"""A level's scenario, load kind ("concurrency" or "request_rate"), load, and whether it probed max_load."""


def level_key(level: BenchLevel) -> LevelKey:
    """What pairs a level with its counterpart in another run: `BenchLevel.key` (scenario, load kind,
    load) and whether it is a probe of max_load, which pairs only with another probe (as compare pairs
    rows), since a probe and a scenario's own level may share a load."""
    return (*level.key, level.probe)


def _record_key(record: dict) -> LevelKey | None:
    """The key of the level a line of requests.jsonl belongs to (it carries its level's scenario, load
    and probe), None when it names no load."""
    rate, conc = record.get("request_rate"), record.get("concurrency")
    kind, load = ("request_rate", rate) if rate is not None else ("concurrency", conc)
    if not isinstance(load, (int, float)) or isinstance(load, bool):
        return None
    scenario = record.get("scenario")
    return (scenario if isinstance(scenario, str) else None, kind, load, bool(record.get("probe")))


@dataclass
class Row:
    label: str
    level: LevelKey
    before: float | None
    after: float | None
    noise: float            # relative band
    noise_source: str

    @property
    def delta(self) -> float | None:
        if self.before in (None, 0) or self.after is None:
            return None
        return (self.after - self.before) / self.before

    @property
    def beyond_noise(self) -> bool:
        return self.delta is not None and abs(self.delta) > self.noise


def compare_runs(original_dir: Path, new_dir: Path) -> dict:
    """Facts that differ and metric rows for two run directories, and `notes`: what kept figures from
    being set side by side (a run without a benchmark, a level only one run has), which an empty or
    short table must not leave unsaid."""
    original, new = load_run_result(RunLayout(Path(original_dir))), load_run_result(RunLayout(Path(new_dir)))
    before, after = original.manifest, new.manifest
    facts = []
    for key in FACTS:
        a, b = (before.facts or {}).get(key), (after.facts or {}).get(key)
        if a != b:
            facts.append({"fact": key, "before": a, "after": b})
    for key in ("gpu", "gpus"):
        a, b = getattr(before.host, key, None), getattr(after.host, key, None)
        if a != b:
            facts.append({"fact": f"host.{key}", "before": a, "after": b})
    if before.harness_version != after.harness_version:
        facts.append({"fact": "harness", "before": before.harness_version, "after": after.harness_version})
    if moved := _model_paths(before, after):
        facts.append({"fact": "model.path (--model-path)", "before": moved[1], "after": moved[0]})
    facts += launch_differences(original, new)
    rows = []
    new_levels = {level_key(lv): lv for lv in new.levels}
    repeats = _repeat_levels(original)
    requests, faults = _requests(original.layout)
    for old in original.levels:
        which = level_key(old)
        for metric, q, label in METRICS:
            samples = [s for s in (_value(lv, metric, q) for lv in repeats.get(which, [])) if s]
            if len(samples) >= 2:
                noise = (max(samples) - min(samples)) / statistics.median(samples)
                source = f"spread of {len(samples)} repeats"
            elif (split := _split_half(requests.get(which, []), metric, q)) is not None:
                noise, source = split, "half-split of the original's requests"
            else:
                noise, source = DEFAULT_NOISE, "assumed"
            rows.append(Row(label, which, _value(old, metric, q), _value(new_levels.get(which), metric, q),
                            max(noise, MIN_NOISE), source))
    old_keys = {level_key(lv) for lv in original.levels}
    added = [lv for lv in new.levels if level_key(lv) not in old_keys and not lv.probe]
    for lv in added:   # a probe of max_load goes where the bisection led, which differs by nature
        rows += [Row(label, level_key(lv), None, _value(lv, metric, q), DEFAULT_NOISE, "assumed")
                 for metric, q, label in METRICS]
    notes = [f"{side}: {why}" for side, run in (("original", original), ("reproduction", new))
             if (why := _no_figures(run))]
    if faults:
        notes.append(f"original: {len(faults)} request(s) of {original.layout.requests} left out of the noise: "
                     + ", ".join(f"{key} not {REQUEST_FIGURES[key]}" for key in dict.fromkeys(faults)))
    if original.levels and new.levels:
        lost = [k for k in old_keys - new_levels.keys() if not k[3]]
        if lost:
            notes.append(f"{len(lost)} level(s) of the original have no counterpart in the reproduction")
        if added:
            notes.append(f"{len(added)} level(s) of the reproduction have none in the original")
    kernels = {"before": _top(original), "after": _top(new)}
    return {"facts": facts, "rows": rows, "kernels": kernels, "status": (before.status, after.status),
            "notes": notes}


def _no_figures(run: RunResult) -> str | None:
    """Why a run has no benchmark figures to compare, None when it has some."""
    if run.levels:
        return None
    if not run.manifest.ok:
        return f"the run {run.manifest.status}, with no benchmark figures"
    bench = run.layout.bench
    if not bench.exists():
        return f"no benchmark figures: {bench} is missing"
    if run.bench is None:
        return f"no benchmark figures: {bench} cannot be read"
    return f"no benchmark figures: {bench} holds no level"


def launch_differences(original: RunResult, new: RunResult) -> list[dict]:
    """Each line of each node's launch.sh that differs, as a fact (`launch.sh`, or `node K launch.sh`
    for a server on several hosts; the line before, the line after): the recorded playbook rendered for
    another host can still launch another server (that host's env from the inventory, its venv, a
    harness that renders otherwise), which must not pass unseen on any node. Each node's folder on
    its host is written RUN_DIR and its workdir WORKDIR; where the two runs' model paths differ
    (`--model-path`: the one change asked for), the new path reads as the recorded one; and comments
    are left out: they differ by nature."""
    moved = _model_paths(original.manifest, new.manifest)
    ranks = sorted({n.rank for n in original.manifest.nodes} | {n.rank for n in new.manifest.nodes} | {0})
    several = len(ranks) > 1
    rows: list[dict[str, Any]] = []
    for rank in ranks:
        fact = f"node {rank} launch.sh" if several else "launch.sh"
        before, after = _launch_lines(original, rank), _launch_lines(new, rank, moved)
        if before is None or after is None:
            # a run that never launched (skipped, or failed before) has nothing to set beside; a node
            # launched in one run only is said, or a difference on it would pass unseen
            if rank > 0 and (before, after) != (None, None) and new.manifest.ok:
                rows.append({"fact": fact, "before": "(no launch.sh)" if before is None else "(launched)",
                             "after": "(no launch.sh)" if after is None else "(launched)"})
            continue
        matcher = difflib.SequenceMatcher(a=before, b=after, autojunk=False)
        for op, i1, i2, j1, j2 in matcher.get_opcodes():
            if op == "equal":
                continue
            old, now = before[i1:i2], after[j1:j2]
            for k in range(max(len(old), len(now))):
                rows.append({"fact": fact, "before": old[k] if k < len(old) else None,
                             "after": now[k] if k < len(now) else None})
    return rows


def _model_paths(before: RunManifest, after: RunManifest) -> tuple[str, str] | None:
    """The model's path now and as recorded, where the two differ (`--model-path`); else None."""
    old, now = (m.model.path if m.model else None for m in (before, after))
    return (now, old) if old and now and old != now else None


def _launch_lines(run: RunResult, rank: int = 0, moved: tuple[str, str] | None = None) -> list[str] | None:
    """Node `rank`'s launch.sh, the lines that launch something, with its run folder on the host as
    RUN_DIR (found from the manifest's workdir, or from the script's own `cd` into it, since the other
    nodes' workdirs are not recorded), that folder's workdir as WORKDIR, and `moved`'s first path (the
    model where it is now) as its second (where it was); None when the node has no launch script (it
    never started). Node k's script is read from where the harness puts it (nodes/node<k>), never from
    a path the manifest names."""
    layout = run.layout if rank == 0 else run.layout.node(rank)
    try:
        text = layout.launch.read_text(errors="replace")
    except OSError:
        return None
    m = run.manifest
    # the folder's end in its workdir: node k's is `<run_id>.node<k>` (`<run_id>` before that was so)
    tails = list(dict.fromkeys([HostRunLayout.of("", m.sweep_id, m.run_id, rank).root,
                                f"/{m.sweep_id}/{m.run_id}"])) if m.sweep_id else []
    folders = []
    workdir = getattr(m.host, "workdir", None)
    if rank == 0 and isinstance(workdir, str) and workdir and tails:
        folders.append(f"{workdir.rstrip('/')}{tails[0]}")
    for line in text.splitlines():
        if line.startswith("cd "):
            with contextlib.suppress(ValueError):
                words = shlex.split(line[3:])
                if len(words) == 1 and words[0].endswith(tuple(tails)):
                    folders.append(words[0])
    for folder in sorted(set(folders), key=len, reverse=True):
        tail = next(t for t in tails if folder.endswith(t))
        text = _substitute(text, folder, "RUN_DIR")
        text = _substitute(text, folder[:-len(tail)], "WORKDIR")
    if moved is not None:
        text = _substitute(text, moved[0], moved[1])
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _substitute(text: str, path: str, name: str) -> str:
    """`text` with `path` written `name`: shell-quoted whole as the template quotes it, or as it is where
    it stands whole (`/m` is no part of `/models`) or heads a longer path (`/m/config.json`)."""
    if not path or path == "/":
        return text
    quoted = shlex.quote(path)
    if quoted != path:
        text = text.replace(quoted, shlex.quote(name))
    return re.sub(r"(?<![\w.\-/])" + re.escape(path) + r"(?![\w.\-])", lambda _: name, text)


NUMBER, NUMBERS = "a number", "a list of numbers"
REQUEST_FIGURES = {"ttft_ms": NUMBER, "e2e_ms": NUMBER, "output_tokens": NUMBER, "itl_ms": NUMBERS}
"""What the half-split reads of a request record (bench.py's), and what each is."""


def _request_fault(record: dict) -> str | None:
    """The first figure of a request record that is not what REQUEST_FIGURES says (absent is no fault)."""
    for key, what in REQUEST_FIGURES.items():
        value = record.get(key)
        if value is None or (value == [] and what == NUMBERS):   # one token out: no gap between tokens
            continue
        if isinstance(value, list) != (what == NUMBERS) or samples(record, key) is None:
            return key
    return None


def _requests(layout: RunLayout) -> tuple[dict[LevelKey, list[dict]], list[str]]:
    """The original's completed requests (requests.jsonl), by the key of their level, and for each record
    left out as not bench.py's (a figure of another kind), the figure: the host wrote the file, as
    compare and the report read it, the rest stands."""
    out: dict[LevelKey, list[dict]] = {}
    faults = []
    for r in read_requests(layout):
        if r.get("error") or (key := _record_key(r)) is None:
            continue
        if (fault := _request_fault(r)) is not None:
            faults.append(fault)
        else:
            out.setdefault(key, []).append(r)
    return out, faults


def _figure(record: dict, key: str) -> float | None:
    """One figure of a request record that `_request_fault` passed, None where absent."""
    found = samples(record, key)
    return found[0] if found else None


def _split_half(requests: list[dict], metric: str, q: str | None) -> float | None:
    """How far the metric moves between the odd and even requests of one run: its noise, from one run."""
    if q is None or len(requests) < 4:
        return None
    def stat(rs: list[dict]) -> float | None:
        values: list[float] = []
        for r in rs:
            if metric == "itl_ms":
                values += samples(r, "itl_ms") or []
            elif metric == "tpot_ms":
                e2e, ttft, tokens = _figure(r, "e2e_ms"), _figure(r, "ttft_ms"), _figure(r, "output_tokens")
                if e2e is not None and ttft is not None and tokens is not None and tokens > 1:
                    values.append((e2e - ttft) / (tokens - 1))
            elif (value := _figure(r, metric)) is not None:
                values.append(value)
        return percentile(sorted(values), float(q[1:])) if values else None
    a, b, whole = stat(requests[0::2]), stat(requests[1::2]), stat(requests)
    if a is None or b is None or not whole:
        return None
    return abs(a - b) / whole


def _repeat_levels(run: RunResult) -> dict[LevelKey, list[BenchLevel]]:
    """The same configuration's repeats in the original sweep (this run included), by level key. Only
    its sweep's: a folder a colleague gathered runs in may hold another sweep's run of that name, whose
    spread says nothing of this run's noise."""
    out: dict[LevelKey, list[BenchLevel]] = {}
    for layout in (RunLayout(p.parent) for p in run.layout.dir.parent.glob(f"*/{run.layout.manifest.name}")):
        try:
            other = load_run_result(layout)
        except Unreadable:
            continue
        theirs, mine = other.manifest, run.manifest
        if (theirs.config.name, theirs.sweep_id) == (mine.config.name, mine.sweep_id) and theirs.ok:
            for lv in other.levels:
                out.setdefault(level_key(lv), []).append(lv)
    return out


def _value(level: BenchLevel | None, metric: str, q: str | None) -> float | None:
    if level is None:
        return None
    return level.stat(metric, q) if q else getattr(level, metric)


def _top(run: RunResult) -> list[tuple[str, float]]:
    return [(k.name, k.share) for k in run.analysis.top[:3]] if run.analysis else []
