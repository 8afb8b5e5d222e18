"""The `harness` command: parse, call the API, print with rich, map errors to exit codes. Nothing else.

Exit codes: 0 all good; 1 a run failed; 2 bad input (file, key and line named; never a traceback);
130 interrupted, after the servers were stopped.
"""

from __future__ import annotations

import datetime as dt
import functools
import gc
import json
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

import harness
from harness.errors import HarnessError, InputError
from harness.report.escape import printable

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Sweep, benchmark, profile and compare LLM server configurations on GPU hosts.")
out = Console()
err = Console(stderr=True)


def _say(line: str) -> None:
    """A line of the harness's own on stderr, as it is (no markup, no highlighting)."""
    err.print(Text(printable(line)), highlight=False)


def _show(console: Console, line: str, **kwargs) -> None:
    """A line that holds names or paths from outside (a sweep's folder, a playbook's path, a reason): as
    written, never markup (`out[/]x` is a folder's name) nor emoji codes."""
    console.print(printable(line), markup=False, emoji=False, **kwargs)


def _writable(path: Path, option: str, *, directory: bool) -> None:
    """Refuse, before any work, an output the command could not write: a file where a directory goes or
    a directory where a file goes, a path through a file, a directory that may not be written in."""
    if path.exists():
        if directory and not path.is_dir():
            raise InputError("is a file, not a directory", file=str(path), key=option)
        if not directory and path.is_dir():
            raise InputError("is a directory: give the path of a file", file=str(path), key=option)
    nearest = path if directory and path.is_dir() else path.parent
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        raise InputError(f"{nearest} is a file, not a directory", file=str(path), key=option)
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise InputError(f"cannot write in {nearest}", file=str(path), key=option)


def _os_error(e: OSError) -> str:
    """An operating system's refusal in one line, naming the path: `PATH: Is a directory`."""
    if e.filename is None:
        return str(e)
    both = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else str(e.filename)
    return f"{both}: {e.strerror or e}"


Inventory = Annotated[Path, typer.Option("-i", "--inventory", help="inventory file")]
Limit = Annotated[str | None, typer.Option("--limit", help="hosts: a name, a group or a glob")]


class TableOrJson(StrEnum):
    table = "table"
    json = "json"


Format = Annotated[TableOrJson, typer.Option("--format", help="table or json")]


def _version(value: bool) -> None:
    if value:
        out.print(f"harness {harness.__version__}")
        raise typer.Exit()


@app.callback()
def root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="print the version and exit")] = False) -> None:
    """Sweep, benchmark, profile and compare LLM server configurations on GPU hosts."""


def exits(fn):
    """Map the exception tree to exit codes: the only place that does."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InputError as e:
            err.print(Text.assemble(("error: ", "red"), printable(str(e))), highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except HarnessError as e:  # a message may hold `[host]` or `[/]`: text, never markup
            err.print(Text.assemble(("error: ", "red"), printable(str(e))), highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except BrokenPipeError:   # `harness analyze --format json | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # nothing left to flush at exit
            raise typer.Exit(1) from None   # quietly, as rich's own output does
        except OSError as e:  # a path the system refused (a directory where a file goes, no space left)
            err.print(Text.assemble(("error: ", "red"), printable(_os_error(e))), highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None
    return wrapper


@app.command()
@exits
def sweep(playbook: Path, inventory: Inventory = Path("inventory.yaml"),
          output: Annotated[Path, typer.Option("-o", "--output", help="results directory")] = Path("results"),
          limit: Limit = None,
          jobs: Annotated[int | None, typer.Option("--jobs", min=1, help="runs in flight at once")] = None,
          resume: Annotated[bool, typer.Option("--resume", help="continue the latest sweep of this playbook")] = False,
          retry_failed: Annotated[bool, typer.Option("--retry-failed", help="with --resume: run the failed "
                                                     "runs again too (a host fixed overnight)")] = False,
          accept_changes: Annotated[bool, typer.Option("--accept-changes", help="with --resume: go on though "
                                                       "the playbook changed (what is left runs with the new "
                                                       "settings)")] = False,
          dry_run: Annotated[bool, typer.Option("--dry-run", help="show the plan; touch no host")] = False,
          retries: Annotated[int, typer.Option(min=0, help="extra attempts after a transient failure")] = 1,
          host_retries: Annotated[int, typer.Option(min=0, help="reconnections to an unreachable host, "
                                                    "with backoff from 5 s to 5 min")] = 5,
          deadline: Annotated[str | None, typer.Option(help="HH:MM: start no run after this time")] = None,
          fail_fast: Annotated[bool, typer.Option("--fail-fast", help="stop at the first failed run")] = False,
          lease: Annotated[float, typer.Option(min=2, help="seconds a server outlives a silent orchestrator")] = 60):
    """Run every configuration of PLAYBOOK on the inventory's hosts and compare them."""
    from harness.executor import Executor, parse_deadline
    from harness.plan import load_sweep
    from harness.report.compare import collect, launch_line, table
    from harness.report.live import Display
    from harness.report.references import sweep_misses
    from harness.results import latest_sweep

    _writable(output, "--output", directory=True)
    until = None
    if deadline:
        try:
            until = parse_deadline(deadline)
        except ValueError:
            raise InputError(f"expected HH:MM, got {deadline!r}", key="--deadline") from None
        if until.date() != dt.date.today():
            err.print(f"note: {deadline} has passed today: the deadline is tomorrow, {until:%Y-%m-%d %H:%M}")
    sw = load_sweep(playbook, inventory, limit=limit)
    _notes(sw.inventory)
    if (retry_failed or accept_changes) and not resume:
        raise InputError("--retry-failed and --accept-changes go with --resume", key="--resume")
    if resume:
        sw.sweep_id = latest_sweep(output, sw.playbook.name).name
    source = None
    if sw.playbook.optuna is not None:
        try:
            from harness.search import Search
        except ModuleNotFoundError as e:
            raise InputError(f"search.optuna needs Optuna ({e}): pip install 'harness[search]'",
                             file=str(playbook), key="search.optuna") from None
        source = Search(sw, output, resume=resume)   # on resume: the study's runs so far, in sw.runs
    if dry_run and resume:
        from harness.resume import plan_resume
        left = plan_resume(sw, output / sw.sweep_id, retry_failed=retry_failed, accept_changes=accept_changes)
        _show(out, f"--resume of {sw.sweep_id} would run {len(left.todo)} of {len(sw.runs)} runs: "
              + (", ".join(s.run_id for s in left.todo) or "none"))
        if source is not None and (done := source.done()):   # it would ask no more: say so, not "then new trials"
            _show(out, f"and no new trial: {done}", highlight=False)
        elif source is not None:
            out.print(f"then new trials until the budget of {source.total} runs ({len(source.trial_of)} asked so "
                      "far), the patience or the space ends the search", highlight=False)
        return
    if dry_run:
        return _print_plan(sw, "table")
    if resume:   # another orchestrator on it: refused before the header, and before a Slurm allocation
        from harness.lock import SweepLock
        with SweepLock(output / sw.sweep_id):
            pass
    what = (f"a search of {source.total} runs at most" if source else f"{len(sw.runs)} runs")
    out.print(Text.assemble("sweep ", (sw.sweep_id, "bold"), f": {what} on {', '.join(h.name for h in sw.hosts)}"
                            + (" (resumed)" if resume else "")))
    if jobs and jobs > len(sw.hosts):
        err.print(f"note: --jobs {jobs}, but one run at a time goes to a host: at most {len(sw.hosts)} at once here")
    from harness.slurm import allocations
    with allocations(sw, log=_say) as (sw, connect):
        outcome = Executor(sw, output, jobs=jobs, events=Display(err), fail_fast=fail_fast, retries=retries,
                           deadline=until, lease_s=lease, host_retries=host_retries, resume=resume,
                           retry_failed=retry_failed, accept_changes=accept_changes,
                           argv=sys.argv[1:], connect=connect, source=source).run()
    rows = collect([outcome.sweep_dir]) if outcome.manifests else []
    if outcome.manifests:
        out.print(table(rows, title=f"{sw.sweep_id}"))
        if launch := launch_line(rows):
            _show(out, launch, highlight=False, soft_wrap=True)
    _print_search([outcome.sweep_dir])
    _show(out, f"results: {outcome.sweep_dir}")
    resume_hint = (f"finish it with: harness sweep {playbook} --resume"
                   + (f" -o {output}" if output != Path("results") else ""))
    if outcome.interrupted:
        _show(err, f"interrupted: {resume_hint}")
        raise typer.Exit(130)
    if outcome.fatal:
        err.print(Text.assemble(("error: ", "red"), printable(outcome.fatal)), soft_wrap=True)
        raise typer.Exit(1)
    if source is not None and source.failure:
        err.print(Text.assemble(("error: ", "red"), printable(source.failure)), soft_wrap=True)
        raise typer.Exit(1)
    misses = sweep_misses(outcome.sweep_dir, rows) if outcome.manifests else []
    for miss in misses:
        err.print(Text.assemble(("reference missed: ", "red"), printable(str(miss))), highlight=False)
    if outcome.failed:
        err.print(f"[red]{len(outcome.failed)} of {len(outcome.manifests)} runs failed[/]")
    skipped = [m for m in outcome.manifests if m.status == "skipped"]
    if skipped:
        _show(err, f"{len(skipped)} runs did not start ({skipped[0].skipped}): {resume_hint}")
    if outcome.failed or misses or skipped:
        raise typer.Exit(1)


@app.command()
@exits
def plan(playbook: Path, inventory: Inventory = Path("inventory.yaml"), limit: Limit = None,
         format: Format = TableOrJson.table):
    """The runs a sweep would do and each rendered launch script; touches no host."""
    from harness.plan import load_sweep
    sw = load_sweep(playbook, inventory, limit=limit)
    _notes(sw.inventory)
    if sw.playbook.optuna is not None:   # what the sweep would refuse, the plan refuses
        from harness.config.space import check
        check(sw)
    _print_plan(sw, format)


def _notes(inventory) -> None:
    """Once each: what of an Ansible inventory the harness kept or ignored."""
    for note in inventory.notes:
        err.print(Text(f"note: {note}", style="dim"), highlight=False)


def _print_search(paths: list[Path]) -> None:
    """A search's trials and its best, with the best's launch command on a line of its own."""
    from harness.report.search_view import render_searches
    for part, launch in render_searches(paths):
        out.print(part)
        if launch:
            _show(out, f"launch: {launch}", highlight=False, soft_wrap=True)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _print_plan(sw, format: str) -> None:
    if sw.playbook.optuna is not None:
        return _print_search_plan(sw, format)
    # pool runs are shown on the host they would take if every run took as long as the others
    entries = []
    for i, run in enumerate(sw.runs):
        if run.nodes > 1:   # a server on several hosts: each node's script, on the run's first hosts
            nodes = run.hosts[:run.nodes]
            entries += [{"run_id": run.run_id, "host": host.name, "config": run.config.name, "node": rank,
                         "script": sw.render(run, host, nodes).script} for rank, host in enumerate(nodes)]
            continue
        host = run.hosts[i % len(run.hosts)]
        entries.append({"run_id": run.run_id, "host": host.name, "config": run.config.name,
                        "script": sw.render(run, host).script})
    if format == "json":
        print(json.dumps(entries, indent=2))
        return
    configs, repeat = len({e["config"] for e in entries}), sw.playbook.repeat
    hosts = f" x {len(sw.hosts)} hosts (placement each)" if sw.playbook.placement == "each" else ""
    out.print(f"{_count(len(sw.runs), 'run')} ({_count(configs, 'configuration')}{hosts} x "
              f"{_count(repeat, 'repeat')}):", highlight=False)
    for e in entries:
        node = f", node {e['node']}" if "node" in e else ""
        out.print(Text.assemble(f"  {e['run_id']}  ", (f"on {e['host']}{node}", "dim")), soft_wrap=True)
    if any(h.workdir.startswith("~") for h in sw.hosts):
        err.print(Text("note: a workdir's leading ~ stands for the host user's home here; the sweep renders each "
                       "script with the absolute folder it finds on the host", style="dim"), highlight=False)
    for e in entries:
        out.rule(Text.assemble(f"{e['run_id']}  ", (f"on {e['host']}", "dim")))
        _show(out, e["script"], highlight=False, soft_wrap=True)


def _print_search_plan(sw, format: str) -> None:
    """What a search will do: its space, budget and objective, and the launch script of its first point.
    As json, the plan's one shape, a list of {run_id, host, config, script}: the first point's run,
    with the search's settings under `search` (a reader of plans, benchmarks/check_engine_flags.py,
    takes any playbook's)."""
    from harness.plan import search_plan
    from harness.report.search_view import plan_text
    plan = search_plan(sw)
    if format == "json":
        settings = {k: v for k, v in plan.items() if k != "example"}
        print(json.dumps([plan["example"] | {"search": settings}], indent=2))
        return
    _show(out, plan_text(plan), highlight=False)
    out.rule(Text.assemble(f"the first point, {plan['example']['run_id']}  ", (f"on {plan['example']['host']}", "dim")))
    _show(out, plan["example"]["script"], highlight=False, soft_wrap=True)


@app.command()
@exits
def check(playbook: Annotated[Path | None, typer.Argument(help="a playbook: check its hosts for its engine "
                                                             "and port")] = None,
          inventory: Inventory = Path("inventory.yaml"), limit: Limit = None,
          engine: Annotated[str | None, typer.Option(help="engine to look for: sglang, vllm, sim... "
                                                     "(default: the playbook's, else any the venv imports)")] = None,
          port: Annotated[int | None, typer.Option(help="server port to check; default: the engine's "
                                                   "(no engine named: none)",
                                                   min=1, max=65535)] = None):
    """Preflight every host: reachable, host key, venv, engine importable, GPUs free, port free, disk."""
    from harness.check import check_hosts, check_these, problem_lines, render

    if playbook is not None:
        from harness.plan import load_sweep
        sw = load_sweep(playbook, inventory, limit=limit)
        _notes(sw.inventory)
        results = check_these(sw.hosts, engine or sw.engine, port or sw.playbook.server.port)
    else:
        results = check_hosts(inventory, limit=limit, engine=engine, port=port)
    out.print(render(results))
    for host, problem in problem_lines(results):   # whole lines (soft wrap): a command or fingerprint copies as one
        out.print(Text.assemble((f"{host}: ", "red"), problem), soft_wrap=True)
    if any(not r.ok for r in results):
        raise typer.Exit(1)


@app.command()
@exits
def bench(url: Annotated[str, typer.Option(help="server base URL, e.g. http://127.0.0.1:30000")],
          model: Annotated[str, typer.Option(help="model name the server answers to")],
          concurrency: Annotated[str, typer.Option(help="levels, comma-separated")] = "1",
          requests: Annotated[int | None, typer.Option(help="requests per level")] = None,
          max_tokens: Annotated[int, typer.Option(help="output tokens per request")] = 50,
          prompt: Annotated[str | None, typer.Option(help="prompt text")] = None,
          prompt_tokens: Annotated[int | None, typer.Option(help="synthetic prompt length")] = None,
          warmup: Annotated[int, typer.Option(help="warm-up requests per level")] = 1,
          api: Annotated[str, typer.Option(help="completions or chat")] = "completions",
          output: Annotated[Path, typer.Option("-o", "--output", help="bench.json path")] = Path("bench.json"),
          header: Annotated[list[str] | None, typer.Option("--header", help="'Name: value', sent with "
                                                           "every request; repeatable")] = None,
          api_key_env: Annotated[str | None, typer.Option(help="the environment variable holding an API key, "
                                                          "sent as a bearer token (never on a command line)")] = None):
    """The decode benchmark alone, against any OpenAI-compatible server."""
    from harness.remote import bench as client
    from harness.report.bench_view import render_bench

    _writable(output, "--output", directory=False)
    _writable(output.with_name("requests.jsonl"), "--output", directory=False)
    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        raise InputError(f"expected comma-separated integers, got {concurrency!r}", key="--concurrency") from None
    headers = {}
    for item in header or []:
        name, colon, value = item.partition(":")
        if not colon:
            raise InputError(f"expected 'Name: value', got {item!r}", key="--header")
        headers[name.strip()] = value.strip()
    if api_key_env:
        if api_key_env not in os.environ:
            raise InputError(f"{api_key_env} is not set in the environment", key="--api-key-env")
        headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
    from harness.report.live import BenchProgress
    client.raise_file_limit()   # a level of many streams holds a socket each
    try:
        with BenchProgress(err) as shown:
            result = client.run_benchmark(url, model, concurrency=levels, requests=requests, warmup=warmup,
                                          max_tokens=max_tokens, prompt=prompt, prompt_tokens=prompt_tokens,
                                          api=api, headers=headers, on_tick=shown.update,
                                          progress=shown.level_done)
    except ValueError as e:  # the client's word for bad arguments
        raise InputError(str(e), key="harness bench") from None
    client.write_results(result, output)
    out.print(render_bench(result))
    _show(out, f"wrote {output} and {output.with_name('requests.jsonl')}")
    failed = client.failures(result)
    if failed:
        _show(err, "requests failed, so these figures cannot be trusted:\n  " + "\n  ".join(failed))
        raise typer.Exit(1)


def _saved_analysis(path: Path) -> Path | None:
    """An analysis.json to show instead of traces: the one named, or a run folder's without a trace."""
    if path.name == "analysis.json" and path.is_file():
        return path
    profile = path / "profile"
    if (path / "analysis.json").is_file() and not (profile.is_dir() and any(profile.rglob("*.json*"))):
        return path / "analysis.json"
    return None


@app.command()
@exits
def analyze(path: Path, top: Annotated[int, typer.Option(min=1, help="kernels to show")] = 15,
            format: Format = TableOrJson.table):
    """Where the GPU time goes: a trace file, a profile directory or a run directory.

    A run directory whose traces are gone (its profile/ removed) shows the analysis.json saved with it."""
    from harness.analysis import analyze_path
    from harness.report.analysis_view import render_analysis

    if (saved := _saved_analysis(path)) is not None:
        from harness.results import AnalysisFile, read_model
        _show(err, f"the traces are not here: the analysis saved with the run, {saved}")
        result = read_model(saved, AnalysisFile).dump()
    else:
        result = analyze_path(path, top=top)
    if format == "json":
        print(json.dumps(result, indent=2))
    else:
        out.print(render_analysis(result, top=top))


@app.command()
@exits
def compare(results: list[Path],
            baseline: Annotated[str | None, typer.Option(help="configuration to compare against (with --by "
                                                         "sweep: the sweep)")] = None,
            format: Annotated[str, typer.Option(help="table, json, csv or markdown")] = "table",
            by: Annotated[str, typer.Option(help="config: one row a configuration, its runs pooled over every "
                                            "sweep given; sweep: each sweep's apart, against the first "
                                            "(before and after an upgrade)")] = "config"):
    """Configurations side by side, from results directories alone; exit 1 when a reference is missed."""
    from harness.report import compare as cmp

    rows = cmp.collect(results, baseline=baseline, by=by)
    if format == "table":
        out.print(cmp.table(rows))
        if launch := cmp.launch_line(rows):
            _show(out, launch, highlight=False, soft_wrap=True)
        _print_search(results)
    elif format in ("json", "csv", "markdown"):
        sys.stdout.write({"json": cmp.as_json, "csv": cmp.as_csv, "markdown": cmp.as_markdown}[format](rows))
    else:
        raise InputError(f"unknown format {format!r}: table, json, csv or markdown", key="--format")
    for line in cmp.unreadable(results) + cmp.not_measured(results):
        _show(err, f"warning: {line}", highlight=False, soft_wrap=True)
    misses = [m["message"] for r in rows for m in r["misses"]]
    if misses:
        err.print(f"[red]{len(misses)} reference(s) missed[/]", highlight=False)
        raise typer.Exit(1)


@app.command()
@exits
def report(results: list[Path],
           output: Annotated[Path, typer.Option("-o", "--output", help="HTML file to write")] = Path("report.html"),
           baseline: Annotated[str | None, typer.Option(help="configuration to compare against")] = None):
    """A self-contained HTML report: comparison, roofline, plots, failures and host facts."""
    from harness.report.html import write_report

    _writable(output, "--output", directory=False)
    _show(out, f"wrote {write_report(results, output, baseline=baseline)}")


@app.command()
@exits
def status(results: Path, format: Format = TableOrJson.table):
    """Progress of a sweep, running or finished, from its journal."""
    from harness.report.status import render, sweep_status

    state = sweep_status(results)
    if format == "json":
        print(json.dumps(state, indent=2))
    else:
        out.print(render(state))
    if state["counts"].get("failed") or state["counts"].get("lost") or state["state"] == "stopped":
        raise typer.Exit(1)


@app.command()
@exits
def reproduce(run_dir: Path, inventory: Inventory = Path("inventory.yaml"),
              host: Annotated[str | None,
                              typer.Option(help="host or group to run on; default: the recorded one")] = None,
              output: Annotated[Path, typer.Option("-o", "--output", help="results directory")] = Path("results"),
              model_path: Annotated[str | None, typer.Option("--model-path", help="the model's path on the host "
                                                             "it runs on now, where it differs from the "
                                                             "recorded model.path")] = None):
    """Run a recorded run again from its directory alone, and show what differs."""
    from harness.executor import Executor
    from harness.report.live import Display
    from harness.report.reproduce_view import render_comparison
    from harness.reproduce import compare_runs, reproduction
    from harness.results import SweepLayout
    from harness.slurm import allocations

    _writable(output, "--output", directory=True)
    with (reproduction(run_dir, inventory, host=host, results=output, model_path=model_path) as prepared,
          allocations(prepared, log=_say) as (sw, connect)):
        _show(out, f"reproducing {run_dir} on {', '.join(h.name for h in sw.hosts)} as sweep {sw.sweep_id}"
              + (f", model.path {model_path}" if model_path is not None else ""))
        outcome = Executor(sw, output, events=Display(err), argv=sys.argv[1:], connect=connect).run()
    if outcome.interrupted:
        _show(err, f"interrupted: the reproduction did not finish; what it left is in {outcome.sweep_dir}")
        raise typer.Exit(130)
    if outcome.fatal or len(outcome.manifests) != 1:
        raise HarnessError(outcome.fatal or f"the reproduction recorded no run in {outcome.sweep_dir}")
    (manifest,) = outcome.manifests
    new_dir = SweepLayout(outcome.sweep_dir).run(manifest.run_id).dir
    out.print(render_comparison(compare_runs(run_dir, new_dir), before=f"original ({run_dir.resolve().name})",
                                after=f"now ({manifest.host.name or sw.hosts[0].name})"))
    _show(out, f"results: {outcome.sweep_dir}")
    if not manifest.ok:
        why = (manifest.error.message if manifest.error else manifest.skipped) or "no error recorded"
        said = "the reproduced run failed: " if manifest.status == "failed" else "the reproduced run did not start: "
        err.print(Text.assemble((said, "red"), printable(why)),
                  highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def main() -> None:
    try:
        app()
    finally:
        # The command is over: what it and its imports made is left to the process's end, not walked
        # by the interpreter's last garbage collection (0.1-0.15 s of every command otherwise).
        gc.freeze()
