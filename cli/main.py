"""The ``gemini-dcp`` command line tool (Typer app).

Each command parses its options, calls one library function and renders the
result: rich tables (and progress bars on stderr for long work) for people,
``--json`` on stdout for scripts. Domain errors (:class:`GeminiError`) and
other user mistakes end with exit code 1 and a one-paragraph message on
stderr, never a traceback; with ``--json`` the same error is also printed on
stdout as ``{"ok": false, "error": ..., "message": ...}``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from enum import Enum
from typing import Annotated, Any, Callable, Optional, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from gemini_dcp.errors import ConfigError, ShardUnavailableError, find_gemini_error  # torch-free: --help stays fast

from .render import (
    bytes_h,
    progress_bar,
    render_doctor,
    render_gc,
    render_inspect,
    render_parity_plan,
    render_plan,
    render_verify,
)

app = typer.Typer(
    name="gemini-dcp",
    help="Inspect, verify, move and clean gemini_dcp checkpoints held in node memory, peer memory and "
    "the persistent tier; plan replica placement; check a host before a job runs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="rich",
)

F = TypeVar("F", bound=Callable[..., Any])

# ---- common options ----------------------------------------------------------------------------------
RootOpt = Annotated[
    Optional[str],
    typer.Option("--root", "-r", help="Tier root of this node. Default: $GEMINI_DCP_ROOT, else /dev/shm/gemini_dcp.",
                 show_default=False),
]
JobOpt = Annotated[
    Optional[str],
    typer.Option("--job", "-j", help="Job id. Default: $TORCHELASTIC_RUN_ID, else 'default'.", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout (for scripts).")]
PersistentOpt = Annotated[
    Optional[str],
    typer.Option("--persistent", "-p", help="fsspec URL of the persistent tier (file:///..., s3://..., memory://...).",
                 show_default=False),
]
StepArg = Annotated[int, typer.Argument(min=0, help="Training step (the checkpoint_id given to dcp.save).", show_default=False)]


def _out() -> Console:
    """stdout console; when piped (not a terminal) and $COLUMNS is unset, wide enough that tables never truncate."""
    console = Console(highlight=False)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(highlight=False, width=160)
    return console


def _err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _emit_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, default=_json_default))


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    return str(o)


def _fail(kind: str, message: str, as_json: bool, code: int = 1) -> None:
    if as_json:
        _emit_json({"ok": False, "error": kind, "message": message})
    _err().print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(code)


def guarded(fn: F) -> F:
    """Turn domain errors and user mistakes into exit code 1 with a message (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json", False))
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except ModuleNotFoundError as exc:
            name = exc.name or str(exc)
            if name.startswith("gemini_dcp"):
                _fail("MissingComponent",
                      f"this command needs {name}, which this installation of gemini-dcp lacks; "
                      "install a complete release (pip install -U gemini-dcp).", as_json)
            top = name.split(".", 1)[0]
            _fail("MissingDependency",
                  f"this command needs the Python module {top!r}, which is not installed in {sys.prefix}: install "
                  f"gemini-dcp's dependencies (pip install -e . in the source tree, or pip install {top}).", as_json)
        except (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError) as exc:
            where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
            _fail(type(exc).__name__, f"{exc.strerror or exc}{where}", as_json)
        except KeyboardInterrupt:
            _err().print("[yellow]interrupted[/]")
            raise typer.Exit(130)
        except Exception as exc:
            found = find_gemini_error(exc)  # also inside DCP's wrappers
            if found is None:
                raise
            _fail(type(found).__name__, str(found), as_json)

    return wrapper  # type: ignore[return-value]


# ---- inspect -----------------------------------------------------------------------------------------
@app.command("inspect")
@guarded
def inspect_cmd(
    root: RootOpt = None,
    job: Annotated[Optional[str], typer.Option("--job", "-j", help="Only this job. Default: every job in the root.",
                                               show_default=False)] = None,
    persistent: PersistentOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Jobs and steps held here: committed or not, sizes, ranks/nodes, replica placement, age, and whether each step is restorable from what this host sees."""
    from gemini_dcp.ops.inspection import inspect_root

    info = inspect_root(root, job, persistent)
    if as_json:
        _emit_json({"ok": True, **info.to_dict()})
        return
    render_inspect(_out(), info)


# ---- verify ------------------------------------------------------------------------------------------
@app.command("verify")
@guarded
def verify_cmd(
    step: Annotated[Optional[int], typer.Argument(min=0, help="Only this step (default: every step held here).",
                                                  show_default=False)] = None,
    root: RootOpt = None,
    job: JobOpt = None,
    persistent: Annotated[Optional[str], typer.Option(
        "--persistent", "-p", help="Also verify every item stored in this persistent tier (fsspec URL).",
        show_default=False)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Recompute the checksum of every shard held here (memory slots; with --persistent, the store too). Exit 1 if any is bad or missing."""
    from gemini_dcp.ops.verify import verify

    with progress_bar(_err(), "verifying", disable=as_json) as tick:
        report = verify(root, job, step, persistent=persistent, progress=tick)
    if as_json:
        _emit_json(report.to_dict())
    else:
        render_verify(_out(), report)
    if not report.ok:
        raise typer.Exit(1)


# ---- flush / restore / export ------------------------------------------------------------------------
@app.command("flush")
@guarded
def flush_cmd(
    step: StepArg,
    to: Annotated[str, typer.Option("--to", help="fsspec URL of the persistent tier; the step goes to <URL>/<job>/step-<STEP>.",
                                    show_default=False)],
    root: RootOpt = None,
    job: JobOpt = None,
    allow_partial: Annotated[bool, typer.Option(
        "--allow-partial", help="Write only the shards this host holds (a partial drop); the other nodes run the same "
        "command and the last one to finish commits the step.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write a step from this node's memory to a persistent store, in the stock DCP layout of the persistent tier. Refuses, listing the missing shards, if this host cannot see the whole step."""
    from gemini_dcp.core.config import resolve_job_id
    from gemini_dcp.persistent.stock_format import materialize_step
    from gemini_dcp.persistent.store import PersistentTier

    jid = resolve_job_id(job)
    dest = PersistentTier(to, jid, writable=True).step_url(step)
    try:
        with progress_bar(_err(), f"flushing step {step}", disable=as_json, unit="bytes") as tick:
            result = materialize_step(step, dest, root=root, job_id=jid, allow_partial=allow_partial, progress=tick)
    except ShardUnavailableError as exc:
        raise ShardUnavailableError(
            f"{exc} On the command line: run `gemini-dcp flush {step} --to {to} --allow-partial` on this node and on "
            "every node holding the missing shards; the last one to finish commits the step."
        ) from exc
    _report_materialized(result, as_json, "flushed")


@app.command("restore")
@guarded
def restore_cmd(
    step: StepArg,
    to: Annotated[str, typer.Option("--to", help="Directory or fsspec URL to write the stock DCP checkpoint to.",
                                    show_default=False)],
    root: RootOpt = None,
    job: JobOpt = None,
    persistent: Annotated[Optional[str], typer.Option(
        "--persistent", "-p", help="Persistent tier to read the shards memory does not hold from.",
        show_default=False)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Materialize a step from whatever tiers hold it (memory here, else --persistent) as a stock DCP checkpoint that plain dcp.load(checkpoint_id=DIR) reads."""
    from gemini_dcp.persistent.stock_format import materialize_step

    dest = to if "://" in to else os.path.abspath(os.path.expanduser(to))
    with progress_bar(_err(), f"restoring step {step}", disable=as_json, unit="bytes") as tick:
        result = materialize_step(step, dest, root=root, job_id=job, persistent=persistent, progress=tick)
    _report_materialized(result, as_json, "restored")


def _report_materialized(result: dict[str, Any], as_json: bool, verb: str) -> None:
    if as_json:
        _emit_json({"ok": True, **result})
        return
    out = _out()
    state = "[green]complete[/]" if result.get("complete") else "[yellow]partial (waiting for the other nodes' parts)[/]"
    out.print(
        f"{verb} step {result['step']} -> {escape(str(result['dest']))}: {state}; "
        f"{result.get('items', 0)} items, {bytes_h(result.get('bytes', 0))} in {len(result.get('files', []))} file(s) "
        f"in {result.get('seconds', 0.0):.2f}s "
        f"(from memory {bytes_h(result.get('from_memory', 0))}, from persistent {bytes_h(result.get('from_persistent', 0))})"
    )
    if result.get("missing"):
        out.print(f"still missing: {', '.join(result['missing'][:20])}{' ...' if len(result['missing']) > 20 else ''}")


class ExportFormat(str, Enum):
    safetensors = "safetensors"
    deepspeed = "deepspeed"


@app.command("export")
@guarded
def export_cmd(
    step: StepArg,
    to: Annotated[str, typer.Option("--to", help="Output directory.", show_default=False)],
    fmt: Annotated[ExportFormat, typer.Option("--format", help="Output format.")] = ExportFormat.safetensors,
    prefix: Annotated[str, typer.Option(
        "--prefix", help="Export the tensors whose names start with this, dropping it from the output names; "
        "'' exports every tensor.")] = "model.",
    max_shard_gb: Annotated[float, typer.Option(
        "--max-shard-gb", min=0.001, help="Split the output into model-0000i-of-0000n.safetensors files above this size.")] = 5.0,
    root: RootOpt = None,
    job: JobOpt = None,
    persistent: PersistentOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Export a step's consolidated weights (HuggingFace safetensors layout) from any tier.

    With --format deepspeed: a DeepSpeed checkpoint (gemini_dcp.integrations.deepspeed) as DeepSpeed's checkpoint
    directory (latest, <tag>/ with every rank's files), which zero_to_fp32.py and universal checkpointing read.
    """
    from gemini_dcp.persistent.export import export_deepspeed, export_safetensors

    out_dir = os.path.abspath(os.path.expanduser(to))
    if fmt is ExportFormat.deepspeed:
        tag_dir = export_deepspeed(step, out_dir, root=root, job_id=job, persistent=persistent)
        files = sorted(_walk_files(tag_dir))
        size = sum(os.path.getsize(f) for f in files)
        if as_json:
            _emit_json({"ok": True, "step": step, "format": fmt.value, "path": str(tag_dir), "files": files, "bytes": size})
            return
        _out().print(f"exported step {step} as {fmt.value} -> {escape(str(tag_dir))} ({len(files)} file(s), {bytes_h(size)}; "
                     f"{escape(os.path.join(out_dir, 'latest'))} names it)")
        return
    spinner = _err().status(f"exporting step {step}", spinner="dots") if not as_json else contextlib.nullcontext()
    with spinner:
        path = export_safetensors(step, out_dir, root=root, job_id=job, persistent=persistent, prefix=prefix,
                                  max_shard_bytes=int(max_shard_gb * (1 << 30)))
    files = sorted(f for f in _walk_files(os.path.dirname(os.fspath(path)))
                   if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"))
    size = sum(os.path.getsize(f) for f in files)
    if as_json:
        _emit_json({"ok": True, "step": step, "format": fmt.value, "path": str(path), "files": files, "bytes": size})
        return
    _out().print(f"exported step {step} as {fmt.value} -> {escape(str(path))} ({len(files)} file(s), {bytes_h(size)})")
    for f in files:
        _out().print(f"  {escape(f)}")


def _walk_files(path: Any) -> list[str]:
    p = os.fspath(path)
    if os.path.isfile(p):
        return [p]
    out = []
    for d, _, names in os.walk(p):
        out.extend(os.path.join(d, n) for n in names)
    return out


# ---- plan --------------------------------------------------------------------------------------------
class Strategy(str, Enum):
    mixed = "mixed"
    group = "group"
    ring = "ring"
    parity = "parity"


@app.command("plan")
@guarded
def plan_cmd(
    nodes: Annotated[int, typer.Option("--nodes", "-n", min=1, help="Number of nodes.", show_default=False)],
    replicas: Annotated[Optional[int], typer.Option("--replicas", "-m", min=1,
                                          help="Copies of each node's checkpoint in CPU memory, its own included "
                                          "(with --strategy parity: the replicas to compare with, default 2).",
                                          show_default=False)] = None,
    strategy: Annotated[Strategy, typer.Option("--strategy", "-s", help="Placement strategy (parity: XOR parity "
                                               "groups of --group nodes instead of replicas).")] = Strategy.mixed,
    group: Annotated[Optional[int], typer.Option(
        "--group", "-g", min=3, help="With --strategy parity: nodes per XOR parity group.", show_default=False)] = None,
    failures: Annotated[Optional[int], typer.Option(
        "--failures", "-k", min=1, help="Show P(recover from memory) for k = 1..K simultaneous node failures "
        "(default: replicas + 1).", show_default=False)] = None,
    checkpoint_gb: Annotated[Optional[float], typer.Option(
        "--checkpoint-gb", min=0.0, help="Checkpoint size per node (GB). With --iteration-s, enables the wasted-time model.",
        show_default=False)] = None,
    iteration_s: Annotated[Optional[float], typer.Option(
        "--iteration-s", min=0.0, help="Time of one training iteration (s).", show_default=False)] = None,
    memory_bw_gbps: Annotated[Optional[float], typer.Option(
        "--memory-bw-gbps", min=0.0, help="GB/s (bytes, not bits) at which a node's checkpoint reaches CPU memory, "
        "peers' included. Default 10 (80 Gbit/s).", show_default=False)] = None,
    persistent_bw_gbps: Annotated[Optional[float], typer.Option(
        "--persistent-bw-gbps", min=0.0, help="GB/s each node gets to persistent storage. Default 2.5 (20 Gbit/s).",
        show_default=False)] = None,
    failures_per_day: Annotated[Optional[float], typer.Option(
        "--failures-per-day", min=0.0, help="Expected failures per day, for the per-day figures. Default 1.",
        show_default=False)] = None,
    persistent_interval_s: Annotated[Optional[float], typer.Option(
        "--persistent-interval-s", min=0.0, help="Seconds between persistent-only checkpoints (default: as often as "
        "possible).", show_default=False)] = None,
    domains: Annotated[Optional[str], typer.Option(
        "--domains", help="Failure domains of the nodes: DxN (D domains of N consecutive nodes, e.g. 4x4), sizes "
        "such as 3,3,2, or a file with one domain name per node, one per line. Adds P(recover from memory) when a "
        "whole domain fails, per strategy, with copies placed blind to domains and spread over them.",
        show_default=False)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Placement table and P(recover from memory) for k simultaneous failures (with --domains: when a whole failure domain fails); with --checkpoint-gb and --iteration-s, GEMINI's expected wasted time per failure and per day vs persistent-only checkpointing."""
    from gemini_dcp.ops.sizing import plan

    figures = {"checkpoint_gb": checkpoint_gb, "iteration_s": iteration_s, "memory_bw_gbps": memory_bw_gbps,
               "persistent_bw_gbps": persistent_bw_gbps, "failures_per_day": failures_per_day,
               "persistent_interval_s": persistent_interval_s}
    cost = {k: v for k, v in figures.items() if v is not None}
    if cost and (checkpoint_gb is None or iteration_s is None):
        raise ConfigError("the wasted-time model needs at least --checkpoint-gb and --iteration-s "
                          "(the bandwidths and --failures-per-day have defaults).")
    if strategy is not Strategy.parity and replicas is None:
        raise ConfigError("give --replicas m (copies of each node's checkpoint, its own included), or --strategy parity --group g.")
    if strategy is not Strategy.parity and group is not None:
        raise ConfigError("--group is the parity group size: use it with --strategy parity.")
    result = plan(nodes, replicas or 2, strategy.value, failures, cost=cost, group=group, domains=domains)
    if as_json:
        _emit_json({"ok": True, **result})
        return
    (render_parity_plan if strategy is Strategy.parity else render_plan)(_out(), result)


# ---- gc ----------------------------------------------------------------------------------------------
@app.command("gc")
@guarded
def gc_cmd(
    keep: Annotated[int, typer.Option("--keep", "-k", min=1, help="Steps to keep (the newest committed one always stays).")] = 2,
    root: RootOpt = None,
    job: JobOpt = None,
    remove_job: Annotated[bool, typer.Option(
        "--remove-job", help="Delete ALL of the job's memory on this node (a finished job). Needs an explicit --job.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Touch a live job anyway: one whose launch lock is held "
                                                         "(a trainer, maybe in another container) or whose files "
                                                         "processes have open.")] = False,
    stop_drain: Annotated[bool, typer.Option(
        "--stop-drain", help="With --remove-job: wait until the job's drain server (it uploads the job's steps to the "
        "persistent tier) has no upload pending, stop it, then remove the job.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Show what would be removed; remove nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Evict old steps of a job from this node's memory, never the newest committed one; free slot files no step uses and no process has open. A live job (its launch lock held, from any container) is left alone without --force. --remove-job drops a finished job entirely."""
    from gemini_dcp.ops.housekeeping import collect_garbage, remove_job as remove

    me = [os.getpid()]
    if remove_job:
        if not job:
            raise ConfigError("--remove-job deletes a whole job's memory: name the job explicitly with --job.")
        rep = remove(root, job, force=force, dry_run=dry_run, exclude_pids=me, stop_drain=stop_drain)
        if as_json:
            _emit_json({"ok": True, "action": "remove-job", **rep.to_dict()})
            return
        verb = "would remove" if dry_run else "removed"
        _out().print(f"{verb} job {rep.job_id!r} from {escape(rep.root)}: {len(rep.steps)} step(s) {rep.steps}, "
                     f"{bytes_h(rep.freed_bytes)} freed")
        return
    if stop_drain:
        raise ConfigError("--stop-drain stops the job's drain server before --remove-job removes the job: use it with --remove-job.")
    rep = collect_garbage(root, job, keep, dry_run=dry_run, exclude_pids=me, force=force)
    if as_json:
        _emit_json({"ok": True, "action": "gc", **rep.to_dict()})
        return
    render_gc(_out(), rep)


# ---- doctor ------------------------------------------------------------------------------------------
@app.command("doctor")
@guarded
def doctor_cmd(
    root: RootOpt = None,
    expected_gb: Annotated[Optional[float], typer.Option(
        "--expected-gb", min=0.0, help="Checkpoint size per node (GiB) the job will save; checked against free tier "
        "space and memory as size x (keep+1) slots x replicas.", show_default=False)] = None,
    keep: Annotated[int, typer.Option("--keep", min=1, help="The job's keep (committed steps retained).")] = 2,
    replicas: Annotated[int, typer.Option("--replicas", "-m", min=1, help="The job's replicas (own copy included).")] = 1,
    build_ext: Annotated[bool, typer.Option(
        "--build-ext", help="Build the C++/CUDA extension now if this machine has no cached build (takes a while).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check the environment a job will run in: tier root, tmpfs, free space, /dev/shm size in containers, memory budget, GPUs, the torch version against the supported range, torchrec support, the extension. Exit 1 if a check fails."""
    from gemini_dcp.ops.doctor import doctor

    rep = doctor(root, expected_gb=expected_gb, keep=keep, replicas=replicas, build_ext=build_ext)
    if as_json:
        _emit_json(rep.to_dict())
    else:
        render_doctor(_out(), rep)
    if not rep.ok:
        raise typer.Exit(1)


# ---- entry point -------------------------------------------------------------------------------------
def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("gemini-dcp")
        except PackageNotFoundError:
            from gemini_dcp import __version__ as v
        typer.echo(f"gemini-dcp {v}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """gemini_dcp's operator tool."""


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``gemini-dcp``)."""
    app(args=argv, prog_name="gemini-dcp")


if __name__ == "__main__":
    main()
