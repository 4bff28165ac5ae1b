"""Rich rendering of the library's reports for people (``--json`` bypasses all of this)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table

STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "info": "cyan"}
STATUS_MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "info": "INFO"}
RESTORE_STYLE = {"memory": "green", "memory+persistent": "green", "persistent": "yellow", "no": "red"}
DRAIN_STYLE = {"durable": "green", "writing": "cyan", "queued": "", "failed": "red"}


def bytes_h(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def age_h(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 90:
        return f"{s:.0f}s"
    if s < 90 * 60:
        return f"{s / 60:.0f}m"
    if s < 36 * 3600:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'; [] -> '-'."""
    if not xs:
        return "-"
    xs = sorted(xs)
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:  # type: ignore[list-item]
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def node_legend(steps: list[Any]) -> dict[str, str]:
    """Short names n0, n1, ... for the node ids of a job, in order of first appearance (newest step first)."""
    names: dict[str, str] = {}
    for st in sorted(steps, key=lambda s: -s.step):
        for n in list(st.rank_nodes) + [h for hs in st.holders.values() for h in hs] + ([st.node_id] if st.node_id else []):
            if n and n not in names:
                names[n] = f"n{len(names)}"
    return names


@contextlib.contextmanager
def progress_bar(console: Console, what: str, *, disable: bool = False, unit: str = "bytes") -> Iterator[Callable[[int, int], None]]:
    """A transient progress bar on ``console`` (stderr); yields ``tick(done, total)``."""
    if disable or not console.is_terminal:
        yield lambda done, total: None
        return
    cols = [TextColumn("[bold]{task.description}"), BarColumn()]
    cols += [DownloadColumn(), TransferSpeedColumn()] if unit == "bytes" else [MofNCompleteColumn()]
    cols.append(TimeElapsedColumn())
    with Progress(*cols, console=console, transient=True) as prog:
        task = prog.add_task(what, total=None)

        def tick(done: int, total: int) -> None:
            prog.update(task, completed=done, total=total or None)

        yield tick


# ---- inspect -------------------------------------------------------------------------------------
def render_inspect(out: Console, info: Any) -> None:
    out.print(f"[bold]tier root[/] {escape(info.root)}   [bold]this node[/] {escape(info.node_id)}"
              + (f"   [bold]persistent[/] {escape(info.persistent)}" if info.persistent else ""))
    if not info.jobs:
        out.print("no jobs in this root")
        return
    for job in info.jobs:
        nr = job.newest_restorable
        out.print()
        nh = getattr(job, "newest_healthy", nr)
        out.print(f"[bold]job {escape(job.job_id)}[/]  {bytes_h(job.usage_bytes)} in memory  "
                  f"newest restorable step: {nr if nr is not None else '[red]none[/]'}"
                  + (f"  newest healthy step: {nh if nh is not None else '[red]none[/]'}" if nh != nr else ""))
        if job.persistent_error:
            out.print(f"[yellow]persistent tier unreadable:[/] {escape(job.persistent_error)}")
        if getattr(job, "problem", None):
            out.print(f"[red]not read:[/] {escape(job.problem)}")
            continue
        if not job.steps:
            out.print("  no steps")
            continue
        legend = node_legend(job.steps)
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
        show_pst = info.persistent is not None
        show_drain = job.drain is not None or any(getattr(s, "drain", None) for s in job.steps)
        cols = [("step", {"justify": "right"}), ("state", {}), ("local", {}), ("peer", {})]
        cols += [("persistent", {})] if show_pst else []
        cols += [("drain", {})] if show_drain else []
        cols += [("size", {"justify": "right"}), ("here", {"justify": "right"}), ("ranks/nodes", {"justify": "right"}),
                 ("age", {"justify": "right"}), ("restorable", {}), ("health", {})]
        for col, kw in cols:
            t.add_column(col, no_wrap=True, **kw)
        notes: list[str] = []
        for st in job.steps:
            if not st.in_memory:
                state = "persistent only"
            elif st.world_size is None:
                state = "[red]unreadable[/]"
            else:
                state = "committed" if st.committed else "[yellow]pending[/]"
            pers = "-" if st.in_persistent is None else ("yes" if st.in_persistent else "no")
            rn = f"{st.world_size}/{len(st.nodes)}" if st.world_size is not None else "-"
            style = RESTORE_STYLE.get(st.restorable, "")
            restorable = f"[{style}]{st.restorable}[/]" if style else st.restorable
            if st.problem:
                notes.append(f"step {st.step}: {st.problem}")
            drain = getattr(st, "drain", None)
            why = getattr(st, "drain_reason", None)
            if drain and why:
                notes.append(f"step {st.step}: drain {drain}: {why}")
            if getattr(st, "bytes_carried", None):  # an incremental save (docs/incremental.md)
                notes.append(f"step {st.step}: incremental: {bytes_h(st.bytes_written)} written, "
                             f"{bytes_h(st.bytes_carried)} carried from the slot")
            health = getattr(st, "health", "unchecked")
            if health == "unhealthy":  # the items and counts behind it (gemini_dcp.health)
                items = ", ".join(f"{escape(str(f))} (rank {r}): {n}" for r, f, n in getattr(st, "nonfinite", []))
                notes.append(f"step {st.step}: unhealthy (restores pass over it): NaN/Inf in {items}")
            hcell = {"healthy": "[green]healthy[/]", "unhealthy": "[red]unhealthy[/]"}.get(health, "-")
            dstyle = DRAIN_STYLE.get(drain or "", "")
            dcell = (f"[{dstyle}]{drain}[/]" if dstyle else drain) if drain else "-"
            row = [str(st.step), state, ranges(st.local_ranks), ranges(st.peer_ranks)] + ([pers] if show_pst else [])
            row += [dcell] if show_drain else []
            row += [bytes_h(st.total_bytes), bytes_h(st.bytes_here) if st.in_memory else "-", rn, age_h(st.age_s), restorable,
                    hcell]
            t.add_row(*row)
        out.print(t)
        newest = next((s for s in reversed(job.steps) if s.holders), None)
        if newest is not None and legend:
            out.print(f"replica placement (step {newest.step}, {newest.placement}, replicas={newest.replicas}):")
            doms = getattr(newest, "domains", {}) or {}

            def dom(n: str) -> str:
                return f" (domain {escape(doms[n])})" if n in doms else ""

            for origin, holders in newest.holders.items():
                ranks = [r for r, n in enumerate(newest.rank_nodes) if n == origin]
                out.print(f"  {legend.get(origin, origin)}{dom(origin)} (ranks {ranges(ranks)}) -> "
                          + ", ".join(legend.get(h, h) + dom(h) for h in holders))
            out.print("nodes: " + "; ".join(f"{short} = {escape(node)}{dom(node)}" for node, short in legend.items()))
        par_step = next((s for s in reversed(job.steps) if getattr(s, "parity", None)), None)
        if par_step is not None:
            par = par_step.parity
            out.print(f"XOR parity (step {par_step.step}, groups of {par['group']}): groups "
                      + "  ".join("{" + ", ".join(legend.get(n, n) for n in g) + "}" for g in par["groups"])
                      + f"; lanes (ranks) {par['lanes']}")
            for sl in par["slots"]:
                out.print(f"  parity slot of rank {sl['rank']}: {escape(sl['path'])}  {bytes_h(sl['parity_bytes'])} "
                          f"of parity for {bytes_h(sl['data_bytes'])} of data")
        for n in notes:
            out.print(f"[yellow]note[/] {escape(n)}")
        if job.drain is not None:
            render_drain(out, job.drain)


def render_drain(out: Console, drain: dict[str, Any]) -> None:
    """This node's drain to the persistent tier: where, how often, what is pending, the last outcomes."""
    every = drain.get("every")
    head = f"persistent drain -> {escape(str(drain.get('url') or '?'))}"
    head += f" (steps that are multiples of {every})" if every else ""
    pending = drain.get("pending") or []
    out.print(f"{head}   pending: {', '.join(map(str, pending)) if pending else 'none'}")
    for label, key, pkey in (("this node's part", "recent", None), ("adopted parts of lost nodes", "adopt_recent", "adopt_pending")):
        entries = drain.get(key) or []
        waiting = drain.get(pkey) if pkey else None
        if not entries and not waiting:
            continue
        parts = []
        for e in entries:
            state = e.get("state", "?")
            style = {"done": "green", "committed": "green", "abandoned": "red", "failed": "red", "retry": "yellow"}.get(state, "")
            text = f"[{style}]{state}[/]" if style else state
            age = age_h(time.time() - e["unix"]) if e.get("unix") else "-"
            why = e.get("reason") or e.get("detail")
            parts.append(f"step {e['step']} {text} {age} ago" + (f" ({escape(str(why))})" if why else ""))
        if waiting:
            parts.append(f"pending: {', '.join(map(str, waiting))}")
        out.print(f"  {label}: " + "; ".join(parts))


# ---- verify --------------------------------------------------------------------------------------
def render_verify(out: Console, report: Any) -> None:
    c = report.counts
    bad = [i for i in report.items if i.status != "ok"]
    if bad:
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for col in ("step", "tier", "item", "rank", "size", "status", "detail"):
            t.add_column(col)
        for i in bad:
            style = "red" if i.status in ("bad", "missing") else "yellow"
            off = f"{i.offset}" if i.offset else ""
            t.add_row(str(i.step), i.tier, escape(f"{i.fqn}{off}"), "-" if i.rank is None else str(i.rank),
                      bytes_h(i.nbytes), f"[{style}]{i.status}[/]", escape(i.detail))
        out.print(t)
    for step, items in sorted(getattr(report, "nonfinite", {}).items()):  # NaN/Inf (gemini_dcp.health)
        listed = ", ".join(f"{escape(f)}: {n}" for f, n in sorted(items.items()))
        out.print(f"step {step}: non-finite values (NaN/Inf): {listed}")
    verdict = "[green]OK[/]" if report.ok else "[bold red]FAILED[/]"
    out.print(f"{verdict} job {escape(report.job_id)}: {len(report.items)} items of steps {report.steps} "
              f"({bytes_h(report.bytes_checked)}) checked in {report.seconds:.2f}s: "
              f"{c['ok']} ok, {c['bad']} bad, {c['missing']} missing"
              + (f", {c['unverified']} without a recorded checksum" if c["unverified"] else ""))


# ---- gc ------------------------------------------------------------------------------------------
def render_gc(out: Console, rep: Any) -> None:
    if rep.live_launches:
        out.print(f"[yellow]left job {escape(rep.job_id)} in {escape(rep.root)} alone[/]: it is live, held by "
                  f"{escape('; '.join(rep.live_launches))} (its writer keeps its own steps; --force to collect anyway)")
        return
    verb = "would evict" if rep.dry_run else "evicted"
    out.print(f"job {escape(rep.job_id)} in {escape(rep.root)} (keep {rep.keep}): {verb} steps {rep.evicted_steps or 'none'}; "
              f"kept {rep.kept_steps or 'none'}")
    fverb = "would free" if rep.dry_run else "freed"
    out.print(f"{fverb} {bytes_h(rep.freed_bytes)} in {len(rep.freed_files)} unused slot file(s)")
    for path, pids in rep.busy_files.items():
        out.print(f"[yellow]kept[/] {escape(path)}: open in process(es) {pids} (a running trainer reuses it)")


# ---- doctor --------------------------------------------------------------------------------------
def render_doctor(out: Console, rep: Any) -> None:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("")
    t.add_column("check")
    t.add_column("detail", overflow="fold")
    t.add_column("fix", overflow="fold")
    for c in rep.checks:
        style = STATUS_STYLE[c.status]
        t.add_row(f"[{style}]{STATUS_MARK[c.status]}[/]", c.name, escape(c.detail), escape(c.fix))
    out.print(t)
    fails = sum(c.status == "fail" for c in rep.checks)
    warns = sum(c.status == "warn" for c in rep.checks)
    out.print(("[green]ready[/]" if not fails else f"[bold red]{fails} check(s) failed[/]")
              + (f", {warns} warning(s)" if warns else ""))


# ---- plan ----------------------------------------------------------------------------------------
def render_plan(out: Console, res: dict[str, Any]) -> None:
    out.print(f"[bold]placement[/] {res['strategy']}: {res['nodes']} nodes, {res['replicas']} copies of each "
              "node's checkpoint (its own included)")
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("node", justify="right")
    t.add_column("copies on")
    t.add_column("stores copies of")
    t.add_column("group/ring", justify="right")
    for row in res["table"]:
        g = row.get("group")
        t.add_row(str(row["node"]), ", ".join(map(str, row["holders"])), ", ".join(map(str, row["stores"])),
                  "-" if g is None else str(g))
    out.print(t)
    if res.get("groups"):
        out.print("groups/rings: " + "  ".join("{" + ", ".join(map(str, g)) + "}" for g in res["groups"]))
    out.print()
    formula = any("group_formula" in r for r in res["recovery"])
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("failures k", justify="right")
    t.add_column("P(recover from memory)", justify="right")
    if formula:
        t.add_column("paper's group formula", justify="right")
    for row in res["recovery"]:
        p = row["p_recover"]
        style = "green" if p >= 0.999999 else ("yellow" if p >= 0.9 else "red")
        cells = [str(row["failures"]), f"[{style}]{p:.4f}[/]"]
        if formula:
            cells.append(f"{row['group_formula']:.4f}")
        t.add_row(*cells)
    out.print(t)
    if formula:
        out.print("(the group formula is exact for k <= replicas and a lower bound above)")
    render_domains(out, res)
    if res.get("wasted_time"):
        out.print()
        render_wasted(out, res.get("cost_inputs", {}), res["wasted_time"])


def render_domains(out: Console, res: dict[str, Any]) -> None:
    """``plan --domains``: P(recover from memory) when a whole failure domain fails, per strategy."""
    rows = res.get("domain_recovery")
    if not rows:
        return
    sizes: dict[str, int] = {}
    for d in res["domains"]:
        sizes[d] = sizes.get(d, 0) + 1
    out.print()
    out.print(f"[bold]failure domains[/]: {len(sizes)} ({', '.join(f'{d}: {n}' for d, n in sizes.items())} nodes)")
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("strategy")
    t.add_column("P(recover | k random nodes)", justify="right")
    t.add_column("P(recover | 1 domain) by node order", justify="right")
    t.add_column("P(recover | 1 domain) spread over domains", justify="right")
    for row in rows:
        name = row["strategy"] + (f" (group {row['group']})" if "group" in row else f" (replicas {row['replicas']})")
        p = row["p_domain_spread"]
        style = "green" if p >= 0.999999 else ("yellow" if p >= 0.5 else "red")
        t.add_row(name, f"k={row['random_failures']}: {row['p_random_failures']:.4f}", f"{row['p_domain_blind']:.4f}",
                  f"[{style}]{p:.4f}[/]")
    out.print(t)
    out.print("(spread: what a job gets with failure_domain= / GEMINI_DCP_FAILURE_DOMAIN set on every node)")


def render_parity_plan(out: Console, res: dict[str, Any]) -> None:
    """``plan --strategy parity``: groups, P(recover from memory), memory and traffic beside replicas."""
    m = res["replicas_compared"]
    out.print(f"[bold]XOR parity[/] over {res['nodes']} nodes, groups of {res['group']} (the last group takes the "
              f"remainder): {len(res['groups'])} group(s), beside replicas={m}")
    out.print("groups: " + "  ".join("{" + ", ".join(map(str, g)) + "}" for g in res["groups"]))
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("failures k", justify="right")
    t.add_column("P(recover) parity", justify="right")
    t.add_column(f"P(recover) replicas={m}", justify="right")
    for row in res["recovery"]:
        t.add_row(str(row["failures"]), f"{row['p_recover']:.4f}", f"{row['p_recover_replicas']:.4f}")
    out.print(t)
    gb = "checkpoint_gb" in res
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("per node")
    t.add_column("parity", justify="right")
    t.add_column(f"replicas={m}", justify="right")
    unit = " GB" if gb else " ckpt"
    for label, key in (("memory (keep+1 slots)", "memory_per_node"), ("sent per save", "sent_per_node_per_save")):
        k = key + "_gb" if gb else key
        t.add_row(label, f"{res[k]:.3g}{unit}", f"{res[k.replace(key, key + '_replicas')]:.3g}{unit}")
    out.print(t)
    out.print(f"(parity per node: {res['parity_per_checkpoint']:.3f} of its checkpoint; exact P: no group loses two nodes)")
    render_domains(out, res)


def _fmt_s(v: Any) -> str:
    if not isinstance(v, (int, float)):
        return str(v)
    if v < 120:
        return f"{v:.2f} s"
    if v < 7200:
        return f"{v / 60:.1f} min"
    return f"{v / 3600:.2f} h"


SYSTEMS = (("gemini", "gemini_dcp (CPU memory)"), ("persistent", "persistent only"))
ROWS = (("checkpoint_s", "checkpoint time"), ("interval_s", "checkpoint interval"), ("retrieval_s", "retrieval time"),
        ("wasted_per_failure_s", "wasted per failure"), ("wasted_per_day_s", "wasted per day"))


def render_wasted(out: Console, inputs: dict[str, Any], wt: dict[str, Any]) -> None:
    """GEMINI's model: checkpoint time + interval / 2 + retrieval time, for both systems."""
    if inputs:
        out.print("inputs: " + ", ".join(f"{k}={v}" for k, v in inputs.items() if v is not None))
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
              title="expected wasted time = checkpoint + interval/2 + retrieval", title_justify="left")
    t.add_column("")
    for _, label in SYSTEMS:
        t.add_column(label, justify="right")
    for key, label in ROWS:
        t.add_row(label, *(_fmt_s(wt.get(f"{prefix}_{key}")) for prefix, _ in SYSTEMS))
    out.print(t)
    ratio = wt.get("persistent_over_gemini")
    if isinstance(ratio, (int, float)):
        out.print(f"persistent-only wastes [bold]{ratio:.1f}x[/] as much time per failure as gemini_dcp")
