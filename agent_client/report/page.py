"""The report as one self-contained HTML page: tables, inline SVG plots, a drill-down per episode.

Everything an episode holds (messages, arguments, results, check names) was written by an agent or
an LLM-written environment, so every such string is HTML-escaped here and the page's one script only
opens, finds and filters elements: it never turns data into markup.
"""

from __future__ import annotations

import json
import time
from html import escape
from typing import Any

from agent_client.models import Record
from agent_client.report import charts
from agent_client.report.measures import ERROR_KINDS, Run, max_repeats, overviews, percentile, tool_use
from agent_client.spread import Comparison, compare, run_spread, scenario_spread
from envscaler.models import StateChange

# Longest text shown for one value (a tool result, a message); the rest is counted, not shown.
_TEXT_LIMIT = 4000
_TOOLS_PLOTTED = 20

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:#1b1f24;background:#fafbfc}
header{background:#24292f;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;color:#c9d1d9}nav a{color:#9ecbff;margin-right:14px}
main{padding:8px 24px 40px;max-width:1400px}.plots{align-items:flex-start}h2{border-bottom:1px solid #d0d7de;padding-bottom:4px;margin-top:32px}
table{border-collapse:collapse;margin:8px 0;background:#fff}th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:right;vertical-align:top}
th{background:#f0f3f6}td.l,th.l{text-align:left}.plots{display:flex;flex-wrap:wrap;gap:18px}
figure{margin:0;background:#fff;border:1px solid #d0d7de;padding:8px}figcaption{font-weight:600;margin-bottom:4px}
svg.chart text{font-size:11px;fill:#1b1f24}svg.chart text.value{fill:#57606a}svg.chart .axis{stroke:#8c959f}
.ok{color:#1a7f37}.bad{color:#cf222e}.warn{color:#9a6700}.muted{color:#57606a}
details.episode{background:#fff;border:1px solid #d0d7de;margin:6px 0;padding:4px 10px}
details.episode>summary{cursor:pointer;font-weight:600}details.episode[open]{box-shadow:0 0 0 2px #0969da33}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f8fa;padding:6px;margin:2px 0;max-height:24em;overflow:auto;text-align:left}
.msg{border-left:3px solid #d0d7de;padding-left:8px;margin:6px 0}.msg .role{font-weight:600;text-transform:uppercase;font-size:11px}
.filter{margin:8px 0}.filter input{width:320px;padding:3px}
"""

# Opens the episode named in the address (#ep-...) and filters the episode list; data is never parsed as markup.
_SCRIPT = """
(function () {
  function openFromHash() {
    var id = decodeURIComponent(location.hash.slice(1));
    var target = id && document.getElementById(id);
    if (target && target.tagName === "DETAILS") { target.open = true; target.scrollIntoView(); }
  }
  window.addEventListener("hashchange", openFromHash);
  openFromHash();
  var box = document.getElementById("episode-filter"), failed = document.getElementById("episode-failed");
  function filter() {
    var words = box.value.toLowerCase().split(/\\s+/).filter(Boolean);
    document.querySelectorAll("#episode-list tbody tr").forEach(function (row) {
      var text = row.textContent.toLowerCase();
      var show = words.every(function (w) { return text.indexOf(w) >= 0; }) &&
                 (!failed.checked || row.getAttribute("data-success") !== "1");
      row.style.display = show ? "" : "none";
    });
  }
  box.addEventListener("input", filter);
  failed.addEventListener("change", filter);
})();
"""


def _text(value: Any) -> str:
    """``value`` as escaped text, JSON for anything that is not a string, cut at the display limit."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, indent=1, default=str)
    if len(text) > _TEXT_LIMIT:
        text = text[:_TEXT_LIMIT] + f"\n[... {len(text) - _TEXT_LIMIT} more characters]"
    return escape(text)


def _table(head: list[str], rows: list[list[str]], *, left: int = 1, attrs: str = "") -> str:
    """A table whose first ``left`` columns are left-aligned; cells are markup already escaped by the caller."""
    cells = "".join(f'<th class="{"l" if i < left else ""}">{h}</th>' for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{c}</td>' for i, c in enumerate(row)) + "</tr>"
                   for row in rows)
    return f"<table {attrs}><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"


def episode_id(run_index: int, record: Record) -> str:
    """The drill-down element's id of ``record`` (usable in the address: ``report.html#ep-...``)."""
    return f"ep-{run_index}-{record.env_id}-{record.task_id}-{record.repeat}"


def _overview_section(runs: list[Run]) -> str:
    parts = ['<h2 id="overview">Overview</h2>']
    for index, run in enumerate(runs):
        rows = overviews(run.records)
        repeats = len(rows[-1].pass_k)
        head = ["environment", "episodes", "judged", "reward", "success"] + [f"pass^{k}" for k in range(1, repeats + 1)] \
            + [f"{kind} err" for kind in ERROR_KINDS] + ["steps/ep", "tokens/ep", "duration p50"]
        body = [[escape(r.name) if r.name != "overall" else "<b>overall</b>", str(r.episodes), str(r.judged),
                 f"{r.mean_reward:.3f}", f"{r.success_rate:.1%}", *(f"{v:.3f}" for v in r.pass_k),
                 *(str(r.errors[kind]) for kind in ERROR_KINDS), f"{r.steps_per_episode:.1f}",
                 f"{r.tokens_per_episode:.0f}", f"{r.duration_p50_s:.2f} s"] for r in rows]
        agents = ", ".join(run.agents) + (f" ({', '.join(run.models)})" if run.models else "")
        parts.append(f'<h3><span style="color:{charts.colour(index)}">&#9632;</span> {escape(run.label)}: '
                     f'{escape(agents)} <span class="muted">{escape(run.path)}</span></h3>')
        parts.append(_table(head, body))
    parts.append('<p class="muted">reward: mean over judged episodes; success: reward 1.0; pass^k: the chance that k '
                 'repeats of a scenario all succeed (tau-bench); errors: failed tool calls by cause (agent: bad '
                 'arguments or unknown tool; tool: the tool answered failure; env: the environment\'s code raised; '
                 'timeout), and infra: episodes that could not be judged.</p>')
    return "".join(parts)


def _plots_section(runs: list[Run]) -> str:
    names = [run.label for run in runs]
    rewards = [(run.label, [r.reward for r in run.records if r.judged]) for run in runs]
    table = {run.label: overviews(run.records) for run in runs}
    curve = [(label, rows[-1].pass_k) for label, rows in table.items()]
    envs = sorted({row.name for rows in table.values() for row in rows[:-1]})
    per_env = [(label, [next((r.mean_reward for r in rows if r.name == env), 0.0) for env in envs]) for label, rows in table.items()]
    uses = {run.label: {(u.env_id, u.tool): u for u in tool_use(run.records)} for run in runs}
    calls: dict[tuple[str, str], int] = {}
    for used in uses.values():
        for key, use in used.items():
            calls[key] = calls.get(key, 0) + use.calls
    tools = sorted(calls, key=lambda key: (-calls[key], key))[:_TOOLS_PLOTTED]
    tool_labels = [f"{env}/{tool}" for env, tool in tools]
    usage = [(label, [float(uses[label][key].calls) if key in uses[label] else 0.0 for key in tools]) for label in names]
    error_rate = [(label, [uses[label][key].failed / uses[label][key].calls if key in uses[label] else 0.0 for key in tools])
                  for label in names]
    latency = []
    for run in runs:
        call_ms = [c.latency_s * 1000 for r in run.records for c in r.trajectory]
        latency.append((run.label, [percentile(call_ms, share) for share in (.5, .9, .99)]))
    duration = [(run.label, [percentile([r.duration_s for r in run.records], share) for share in (.5, .9, .99)]) for run in runs]
    figures = [
        ("Reward distribution (share of judged episodes)", charts.histogram("reward distribution", rewards)),
        ("pass^k curves", charts.curves("pass^k", curve)),
        ("Mean reward per environment", charts.bars("mean reward per environment", envs, per_env, scale=1.0)),
        (f"Tool calls (top {len(tools)})", charts.bars("tool calls", tool_labels, usage, fmt=lambda v: f"{v:.0f}")),
        ("Tool error rate (failed calls / calls)", charts.bars("tool error rate", tool_labels, error_rate, scale=1.0,
                                                               fmt=lambda v: f"{v:.0%}")),
        ("Tool-call latency percentiles (ms)", charts.bars("tool-call latency", ["p50", "p90", "p99"], latency,
                                                           fmt=lambda v: f"{v:.1f}")),
        ("Episode duration percentiles (s)", charts.bars("episode duration", ["p50", "p90", "p99"], duration,
                                                         fmt=lambda v: f"{v:.2f}")),
    ]
    body = "".join(f"<figure><figcaption>{escape(caption)}</figcaption>{svg}</figure>" for caption, svg in figures)
    return f'<h2 id="plots">Plots</h2><div class="plots">{body}</div>'


def _spread_section(runs: list[Run]) -> str:
    parts = ['<h2 id="spread">Repeats and spread</h2>',
             '<p class="muted">Per scenario over its repeats: a flaky scenario succeeded in some repeats and failed '
             'in others; sd is the standard deviation of its reward between repeats.</p>']
    for run in runs:
        rows = scenario_spread(run.records)
        summary = run_spread(rows)
        parts.append(f"<h3>{escape(run.label)}</h3><p>{summary.scenarios} scenario(s), {summary.repeated} repeated; "
                     f"<b>{summary.flaky}</b> flaky; mean reward sd between repeats {summary.mean_reward_sd:.3f}</p>")
        rows.sort(key=lambda s: (not s.flaky, s.success_rate, s.env_id, s.task_id))
        parts.append(_table(["scenario", "repeats", "successes", "success rate", "mean reward", "reward sd", "flaky"],
                            [[escape(f"{s.env_id}/{s.task_id}"), str(s.runs), str(s.successes), f"{s.success_rate:.0%}",
                              f"{s.mean_reward:.3f}", f"{s.reward_sd:.3f}", '<span class="warn">yes</span>' if s.flaky else ""]
                             for s in rows]))
    return "".join(parts)


def _comparison(comparison: Comparison) -> str:
    c = comparison
    verdict = ('<span class="ok">significant at the 5% level</span>' if c.p_value < 0.05
               else '<span class="muted">not significant at the 5% level</span>')
    needed = f"{c.repeats_needed} ({escape(c.repeats_note)})" if c.repeats_needed is not None else escape(c.repeats_note)
    head = _table(["A", "B", "scenarios", "mean A", "mean B", "B - A", "95% CI", "p", "repeats needed"],
                  [[escape(c.name_a), escape(c.name_b), str(c.scenarios), f"{c.mean_a:.3f}", f"{c.mean_b:.3f}",
                    f"<b>{c.difference:+.3f}</b>", f"[{c.ci_low:+.3f}, {c.ci_high:+.3f}]", f"{c.p_value:.4f}", needed]], left=2)
    differing = sorted((d for d in c.per_scenario if d.difference != 0), key=lambda d: (-abs(d.difference), d.env_id, d.task_id))
    rows = [[escape(f"{d.env_id}/{d.task_id}"), f"{d.a.successes}/{d.a.runs}", f"{d.b.successes}/{d.b.runs}",
             f"{d.a.mean_reward:.3f}", f"{d.b.mean_reward:.3f}",
             f'<span class="{"ok" if d.difference > 0 else "bad"}">{d.difference:+.3f}</span>', f"{d.p_value:.3f}"]
            for d in differing]
    others = f"{c.scenarios - len(differing)} scenario(s) score the same on both sides"
    missing = f"; only in A: {c.only_a}, only in B: {c.only_b}" if c.only_a or c.only_b else ""
    return (f"<h3>{escape(c.name_a)} (A) against {escape(c.name_b)} (B): {verdict}</h3>{head}"
            f"<p>{len(differing)} scenario(s) differ; {others}{missing}.</p>"
            + _table(["scenario", "A successes", "B successes", "A reward", "B reward", "B - A", "p"], rows))


def _compare_section(runs: list[Run]) -> str:
    if len(runs) < 2:
        return ""
    comparisons = [compare(runs[0].records, run.records, runs[0].label, run.label) for run in runs[1:]]
    return ('<h2 id="compare">Side by side</h2><p class="muted">Each scenario is one unit: its repeats are averaged '
            'first, so repeats do not count as independent evidence. B - A is the mean over common scenarios of the '
            'per-scenario reward difference; its 95% interval uses the clustered standard error; p is a sign-flip '
            'permutation test over scenarios (per scenario: a permutation test of the repeats). Repeats needed: '
            'repeats per scenario on each side for an 80% chance to find a difference this large at the 5% level '
            'with these scenarios, from the repeat noise measured here.</p>'
            + "".join(_comparison(c) for c in comparisons))


def _tools_section(runs: list[Run]) -> str:
    parts = ['<h2 id="tools">Tools</h2>']
    for run in runs:
        rows = tool_use(run.records)
        parts.append(f"<h3>{escape(run.label)}</h3>")
        parts.append(_table(["environment", "tool", "calls", "failed", *[f"{k} err" for k in ERROR_KINDS[:-1]],
                             "p50 ms", "p90 ms", "p99 ms"],
                            [[escape(u.env_id), escape(u.tool), str(u.calls), f"{u.failed} ({u.failed / u.calls:.0%})",
                              *(str(u.errors.get(k, 0)) for k in ERROR_KINDS[:-1]),
                              *(f"{u.latency_ms[p]:.1f}" for p in ("p50", "p90", "p99"))] for u in rows], left=2))
    return "".join(parts)


def _net_changes(record: Record) -> list[StateChange]:
    """What the episode changed in the state, path by path: the first value before and the last after."""
    changes: dict[str, StateChange] = {}
    for call in record.trajectory:
        for change in call.diff or []:
            key = json.dumps(change.path)
            if key in changes:
                changes[key] = StateChange(path=change.path, before=changes[key].before, after=change.after,
                                           op=change.op if changes[key].op == "replace" else changes[key].op)
            else:
                changes[key] = change.model_copy()
    return [c for c in changes.values() if c.op != "replace" or c.before != c.after]


def _changes_table(changes: list[StateChange]) -> str:
    return _table(["path", "op", "before", "after"],
                  [[escape("/".join(str(p) for p in c.path)), c.op, f"<pre>{_text(c.before)}</pre>",
                    f"<pre>{_text(c.after)}</pre>"] for c in changes], left=4)


def _message(message: dict[str, Any]) -> str:
    role = escape(str(message.get("role", "?")))
    parts = [f'<div class="msg"><span class="role">{role}</span>']
    if message.get("tool_call_id"):
        parts.append(f' <span class="muted">for {escape(str(message["tool_call_id"]))}</span>')
    if message.get("content"):
        parts.append(f"<pre>{_text(message['content'])}</pre>")
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        parts.append(f'<div>calls <b>{escape(str(function.get("name")))}</b> <span class="muted">'
                     f'{escape(str(call.get("id", "")))}</span><pre>{_text(function.get("arguments"))}</pre></div>')
    return "".join(parts) + "</div>"


def _episode(run_index: int, run: Run, record: Record) -> str:
    reward = "-" if record.reward is None else f"{record.reward:.3f}"
    mark = "ok" if record.reward == 1.0 else "bad"
    task = next((m.get("content") for m in record.messages if m.get("role") == "user"), None)
    tokens = record.usage.prompt_tokens + record.usage.completion_tokens
    facts = (f"termination <b>{escape(record.termination)}</b>, {record.steps} step(s), {record.duration_s:.2f} s, "
             f"{tokens} tokens, episode {escape(record.episode_id or '-')}")
    parts = [f'<details class="episode" id="{escape(episode_id(run_index, record))}"><summary>'
             f'<span class="{mark}">{reward}</span> {escape(run.label)}: {escape(record.env_id)}/{escape(record.task_id)} '
             f'repeat {record.repeat}</summary><p>{facts}</p>']
    if record.error:
        parts.append(f'<p class="bad">error: {_text(record.error)}</p>')
    parts.append(f"<h4>Task</h4><pre>{_text(task or '(no user message)')}</pre>")
    parts.append(f"<h4>Checks ({sum(c.passed for c in record.checks)}/{len(record.checks)} passed)</h4>")
    parts.append(_table(["check", "result", "error"],
                        [[escape(c.check_item), '<span class="ok">pass</span>' if c.passed else '<span class="bad">FAIL</span>',
                          escape(c.error or "")] for c in record.checks], left=3))
    calls = []
    for number, call in enumerate(record.trajectory, start=1):
        outcome = (f'<span class="bad">{escape(call.error_kind or "error")}: {_text(call.error)}</span>'
                   if call.error else '<span class="ok">ok</span>')
        changed = "; ".join("/".join(str(p) for p in c.path) for c in call.diff or [])
        calls.append([str(number), f"<b>{escape(call.name)}</b>", f"<pre>{_text(call.arguments)}</pre>",
                      f"<pre>{_text(call.result)}</pre>" + (' <span class="warn">(truncated)</span>' if call.truncated else ""),
                      outcome, f"{call.latency_s * 1000:.1f}", escape(changed)])
    parts.append(f"<h4>Tool calls ({len(record.trajectory)})</h4>")
    parts.append(_table(["#", "tool", "arguments", "result", "outcome", "ms", "changed"], calls, left=7))
    changes = _net_changes(record)
    parts.append(f"<h4>State change ({len(changes)} value(s))</h4>" + (_changes_table(changes) if changes else "<p>none</p>"))
    parts.append(f"<details><summary>Messages ({len(record.messages)})</summary>"
                 + "".join(_message(m) for m in record.messages) + "</details>")
    return "".join(parts) + "</details>"


def _episodes_section(runs: list[Run]) -> str:
    rows, details = [], []
    for index, run in enumerate(runs):
        for record in sorted(run.records, key=lambda r: (r.env_id, r.task_id, r.repeat)):
            target = escape(episode_id(index, record))
            reward = "-" if record.reward is None else f"{record.reward:.3f}"
            failed_checks = sum(not c.passed for c in record.checks)
            rows.append(f'<tr data-success="{int(record.reward == 1.0)}"><td class="l">{escape(run.label)}</td>'
                        f'<td class="l"><a href="#{target}">{escape(record.env_id)}/{escape(record.task_id)}</a></td>'
                        f'<td>{record.repeat}</td><td class="{"ok" if record.reward == 1.0 else "bad"}">{reward}</td>'
                        f'<td>{failed_checks}</td><td class="l">{escape(record.termination)}</td><td>{record.steps}</td>'
                        f'<td>{sum(c.error is not None for c in record.trajectory)}</td></tr>')
            details.append(_episode(index, run, record))
    head = "".join(f'<th class="{c}">{h}</th>' for h, c in (("run", "l"), ("scenario", "l"), ("repeat", ""), ("reward", ""),
                                                          ("failed checks", ""), ("termination", "l"), ("steps", ""),
                                                          ("failed calls", "")))
    return ('<h2 id="episodes">Episodes</h2><div class="filter"><input id="episode-filter" type="search" '
            'placeholder="filter: words of run, scenario, termination"> <label><input id="episode-failed" type="checkbox"> '
            'not fully successful only</label></div>'
            f'<table id="episode-list"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
            '<h2 id="drill-down">Drill-down</h2><p class="muted">Click an episode above or below to open it.</p>'
            + "".join(details))


def render(runs: list[Run]) -> str:
    """The whole report page for ``runs`` (the first is A in comparisons)."""
    total = sum(len(run.records) for run in runs)
    title = "EnvScaler run report: " + ", ".join(run.label for run in runs)
    nav = "".join(f'<a href="#{anchor}">{name}</a>' for anchor, name in (
        ("overview", "Overview"), ("plots", "Plots"), ("spread", "Repeats and spread"), ("compare", "Side by side"),
        ("tools", "Tools"), ("episodes", "Episodes")) if anchor != "compare" or len(runs) > 1)
    repeats = max((max_repeats(run.records) for run in runs), default=1)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head><body>'
            f'<header><h1>{escape(title)}</h1><p>{len(runs)} run(s), {total} episode(s), up to {repeats} repeat(s) per '
            f'scenario; written {time.strftime("%Y-%m-%d %H:%M:%S")}</p><nav>{nav}</nav></header><main>'
            + _overview_section(runs) + _plots_section(runs) + _spread_section(runs) + _compare_section(runs)
            + _tools_section(runs) + _episodes_section(runs)
            + f"</main><script>{_SCRIPT}</script></body></html>")

