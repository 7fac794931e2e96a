"""Reports of an online run: a markdown table and a PNG of alpha over requests."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from onlinespec.metrics import moving_average  # noqa: E402
from onlinespec.routing.domains import SHARED  # noqa: E402


def write_report(results: dict[str, dict], out_dir: str | Path, title: str, command: str = "") -> Path:
    """``results`` maps a run label (e.g. "online", "static") to :func:`run_stream`'s output."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = out_dir / "alpha.png"
    plot_alpha(results, plot, title)
    lines = [f"# {title}", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += ["| run | domain | requests | tokens/s | alpha mean | alpha first 50 | alpha last 50 |", "|---|---|---|---|---|---|---|"]
    for label, result in results.items():
        for name, fig in [("all", result["summary"]), *result["domains"].items()]:
            if not fig.get("n_requests"):
                continue
            lines.append(
                f"| {label} | {name} | {fig['n_requests']} | {fig['tokens_per_s']:.1f} | {fig['acceptance_rate_mean']:.3f} | "
                f"{fig['acceptance_rate_first_50']:.3f} | {fig['acceptance_rate_last_50']:.3f} |"
            )
    for label, result in results.items():
        if result["updates"]:
            lines += ["", f"{label}: " + "; ".join(update_counts(result["updates"])) + " (the gate refused the rest)."]
        lines += comparison_lines(label, result.get("comparison"))
        lines += health_lines(label, result)
    lines += ["", f"![alpha over requests]({plot.name})", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def health_lines(label: str, result: dict) -> list[str]:
    """Failed requests, failed updates, stopped learners, and the training data's governance."""
    lines = []
    errors = result.get("errors", [])
    if errors:
        lines += ["", f"{label}: {len(errors)} requests failed (left out of the figures); the first: {errors[0]['id']}: {errors[0]['error']}"]
    learner = result.get("learner", {})
    for name, failures in learner.get("update_failures", {}).items():
        lines += ["", f"{label}: draft {name}: {len(failures)} updates failed; the last: {failures[-1]}"]
    for name, reason in learner.get("learners_stopped", {}).items():
        lines += ["", f"{label}: draft {name}: the learner stopped: {reason}"]
    share = learner.get("learning", {})
    if "share_limit" in share:
        lines += ["", f"Learning ({label}): {share['engine_seconds']:.1f} s of the engine's time in {share['turns']} turns "
                  f"(the longest {share.get('longest_turn_seconds', 0):.2f} s); share "
                  f"spent over the last 30 s {share['share_spent']:.1%} (allowed under load {share['share_limit']:.1%}); update "
                  "interval backoff by draft: " + (", ".join(f"{k} x{v}" for k, v in share.get("backoff", {}).items()) or "none")]
    governance = result.get("governance")
    if governance:
        lines += ["", f"Training data ({label}): " + ", ".join(f"{key.replace('_', ' ')} {value}" for key, value in governance.items())]
    return lines


def ci_text(comparison: dict) -> str:
    interval = comparison.get("online/static_95ci")
    return f" (95% bootstrap interval over requests {interval[0]:.3f}-{interval[1]:.3f})" if interval else ""


def update_counts(updates: list[dict]) -> list[str]:
    """'draft code: 3 updates (2 shifted), 1 published, 2 decidable', one per draft, in the order the
    drafts first updated (shifted: larger steps on new traffic, onlinespec.online.schedule;
    decidable: the gain exceeded its paired noise; floor: the starting draft served again)."""
    by_draft: dict[str, list[dict]] = {}
    for update in updates:
        by_draft.setdefault(update.get("draft", SHARED), []).append(update)
    def line(name: str, us: list[dict]) -> str:
        shifted = sum(u.get("phase") == "shifted" for u in us)
        text = f"draft {name}: {len(us)} updates{f' ({shifted} shifted)' if shifted else ''}, {sum(bool(u['version']) for u in us)} published"
        judged = [u for u in us if u.get("decidable") is not None]
        if judged:
            text += f", {sum(u['decidable'] for u in judged)} of {len(judged)} decidable"
        floors = sum(u.get("outcome") == "floor" for u in us)
        return text + (f", {floors} fell back to the starting draft (the floor)" if floors else "")
    return [line(name, us) for name, us in by_draft.items()]


def plot_alpha(results: dict[str, dict], path: Path, title: str) -> None:
    """alpha over requests per run; where requests were also served by the static draft (probes),
    its alpha on them, and a second panel with online / static tokens/s on the same requests."""
    probed = {label: [r for r in result["requests"] if "static" in r] for label, result in results.items()}
    compared = any(probed.values())
    fig, axes = plt.subplots(2 if compared else 1, 1, figsize=(10, 7 if compared else 4), sharex=True, squeeze=False)
    ax = axes[0][0]
    for label, result in results.items():
        rows, probes = result["requests"], probed[label]
        partial = bool(probes) and len(probes) < len(rows)
        ax.plot([r["i"] for r in rows], [r["alpha_moving_average"] for r in rows], label=f"{label}, all requests" if partial else label,
                **({"alpha": 0.35, "linewidth": 0.8} if partial else {}))
        if probes:  # online and static on the same requests, each averaged over the same span of the stream
            window = max(1, round(len(probes) / len(rows) * 50))
            curves = [(label, None, "-")] if partial else []  # (with every request compared, the curve above is it)
            curves.append(("static draft", "static", "--"))
            if "fresh" in probes[0]:  # the draft born from nothing, learning from the compared requests
                curves.append(("fresh draft (born from the target, learning)", "fresh", ":"))
            for who, key, style in curves:
                average = moving_average([(r[key] if key else r)["acceptance_rate"] for r in probes], window)
                ax.plot([r["i"] for r in probes], average, linestyle=style,
                        label=f"{who}, the {len(probes)} compared requests" if partial else f"{who} (same requests)")
            ratio = [r["tokens_per_s"] / r["static"]["tokens_per_s"] for r in probes if r["static"]["tokens_per_s"]]
            axes[1][0].plot([r["i"] for r in probes if r["static"]["tokens_per_s"]], moving_average(ratio, window),
                            label=f"{label} / static, moving average of {window} compared requests")
    rows = next(iter(results.values()))["requests"]
    for row_axes in axes:
        for i in range(1, len(rows)):
            if rows[i]["domain"] != rows[i - 1]["domain"]:
                row_axes[0].axvline(i, color="grey", linestyle="--", linewidth=0.8)
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i]["domain"] != rows[start]["domain"]:
            ax.text((start + i) / 2, 1.0, rows[start]["domain"], ha="center", va="bottom", transform=ax.get_xaxis_transform())
            start = i
    ax.set_ylabel("alpha, moving average of the last 50 requests")
    ax.set_title(title, pad=18)
    ax.legend()
    if compared:
        axes[1][0].axhline(1.0, color="black", linewidth=0.8)
        axes[1][0].set_ylabel("tokens/s ratio")
        axes[1][0].legend()
    axes[-1][0].set_xlabel("request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def comparison_lines(label: str, comparison: dict | None) -> list[str]:
    """The side-by-side table of a run served with ``compare_every``: the same requests served by
    the online system, the static starting draft and the target alone, by one server."""
    if not comparison:
        return []
    tps, ratio = comparison["tokens_per_s"], comparison["median_ratio"]
    alpha, fresh = comparison["acceptance_rate"], "fresh" in comparison["tokens_per_s"]
    last = comparison.get("last_50_compared", {})
    lines = [
        "", f"### {label}: the same {comparison['n_requests']} requests, {'four' if fresh else 'three'} ways (one run)", "",
        "| | online draft | static draft |" + (" fresh draft (born from the target, learning) |" if fresh else "") + " target alone |",
        "|---|---|---|---|" + ("---|" if fresh else ""),
        f"| tokens/s | {tps['online']:.1f} | {tps['static']:.1f} |" + (f" {tps['fresh']:.1f} |" if fresh else "") + f" {tps['target_alone']:.1f} |",
        f"| median ratio to target alone | {ratio['online/target_alone']:.2f}x | {ratio['static/target_alone']:.2f}x |"
        + (" - |" if fresh else "") + " 1.00x |",
        f"| alpha | {alpha['online']:.3f} | {alpha['static']:.3f} |" + (f" {alpha['fresh']:.3f} |" if fresh else "") + " - |",
        *([f"| alpha, last 50 compared | {last['online']:.3f} | {last['static']:.3f} | {last['fresh']:.3f} | - |"] if last else []),
        "", f"Online / static: {tps['online'] / tps['static']:.3f}x pooled{ci_text(comparison)}, {ratio['online/static']:.3f}x median per request. "
        f"Greedy output identical on {comparison['identical']}/{comparison['n_requests']}.",
    ]
    onoff = comparison.get("learning_on_vs_off")
    if onoff:
        lines.append(f"Serving throughput with the learner running, relative to learning paused (the static draft on the "
                     f"same requests, at the same concurrency): {onoff['static']:.1%} pooled, {onoff['static_median_ratio']:.1%} "
                     f"median per request ({onoff['requests_with_learner_busy']} of {comparison['n_requests']} "
                     f"served while an update ran).")
    return lines


# ---- content routing (``onlinespec routing-report``) ----------------------------------------------------

ROUTER_MARKS = {"drift": ("red", "detection"), "cluster_returned": ("orange", "cluster returned"),
                "draft_spawned": ("green", "draft spawned"), "draft_evicted": ("grey", "draft evicted"),
                "draft_reloaded": ("blue", "draft reloaded"), "merge": ("purple", "clusters merged")}


def routing_events(out_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(served requests in the order they ended, router events) from a server's ``events.jsonl``."""
    import json

    requests, router = [], []
    for line in (Path(out_dir) / "events.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        event = json.loads(line)
        if event["event"] == "request" and "cluster" in event:
            requests.append(event)
        elif event["event"] in ROUTER_MARKS:
            router.append(event)
    return requests, router


def routing_report(out_dir: str | Path, path: str | Path, segments: list[tuple[int, str]] | None = None,
                   window: int = 20) -> dict:
    """A PNG of content routing over a run (``out_dir``: the server's): each request's cluster,
    coloured by the draft that served it; alpha; detections, spawned, evicted and reloaded drafts,
    merges. ``segments``: (first request, label) of a known stream's parts, drawn as bands. Returns
    the counts shown."""
    requests, router = routing_events(out_dir)
    if not requests:
        raise ValueError(f"{out_dir}/events.jsonl holds no content-routed request: was the server started with --router content?")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    drafts = list(dict.fromkeys(r["draft"] for r in requests))
    colours = plt.get_cmap("tab10")
    x = list(range(1, len(requests) + 1))
    for j, name in enumerate(drafts):
        mine = [(i, r["member_of"]) for i, r in zip(x, requests) if r["draft"] == name]
        top.scatter([i for i, _ in mine], [c for _, c in mine], s=9, color=colours(j % 10), label=f"served by {name}")
    bottom.plot(x, moving_average([r["alpha"] for r in requests], window), color="black", label=f"alpha ({window}-request moving average)")
    seen = set()
    counts: dict[str, int] = {}
    for event in router:
        colour, label = ROUTER_MARKS[event["event"]]
        counts[label] = counts.get(label, 0) + 1
        at = event.get("routed") or event.get("requests_served", 0)
        for axis in (top, bottom):
            axis.axvline(at, color=colour, alpha=0.5, lw=1, ls="--" if event["event"] != "drift" else "-",
                         label=label if axis is top and label not in seen else None)
        seen.add(label)
    for start, name in segments or []:
        for axis in (top, bottom):
            axis.axvspan(start, start + 1, color="black", alpha=0.15)
        top.annotate(name, (start + 2, 1.0), xycoords=("data", "axes fraction"), va="top", fontsize=9)
    top.set_ylabel("the prompt's cluster")
    bottom.set_ylabel("alpha")
    bottom.set_xlabel("request (in the order they ended)")
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    bottom.legend(fontsize=7, loc="lower right")
    top.set_title(f"content routing: {len(requests)} requests, {len(drafts)} drafts served, "
                  + ", ".join(f"{k}: {n}" for k, n in counts.items()))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"requests": len(requests), "drafts_served": drafts, **counts}
