"""PNG plots for ``pipespec_mpi.analysis.report`` (matplotlib, Agg canvas; no pyplot global state).

Every function takes data already aggregated by ``report`` (via ``metrics``), draws one figure,
writes it to ``path`` and returns the path, or ``None`` when there is nothing to draw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from pipespec_mpi.records import PairAcceptance, Record

KIND_COLORS = {
    "prefill": "#7b3294",  # purple
    "draft": "#1f78b4",  # blue
    "verify": "#33a02c",  # green
    "own": "#ff7f00",  # orange
    "wait": "#d9d9d9",  # light grey
}
KIND_LABELS = {
    "prefill": "prefill (prompt forward)",
    "draft": "draft (one-token proposal)",
    "verify": "verify (proposals in one forward)",
    "own": "own step (nothing to verify)",
    "wait": "wait (idle)",
}
METHOD_COLORS = {"ar": "#555555", "sd": "#1f78b4", "pipespec": "#e31a1c"}
STAGE_COLORS = ["#a6cee3", "#1f78b4", "#b2df8a", "#33a02c", "#fb9a99", "#e31a1c", "#fdbf6f"]
DPI = 120


def _save(fig: Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=DPI)
    return path


def _method_label(row: Mapping | None, method: str) -> str:
    la = row.get("window") if row else None
    return method if la is None else f"{method}, window {la}"


def _row_label(row: Mapping, with_run: bool) -> str:
    out = row["method"] if row["window"] is None else f"{row['method']}\nwindow {row['window']}"
    return f"{out}\nrun {row['run']}" if with_run else out


# --------------------------------------------------------------------------------------------
# paper Fig. 3


def accepted_histogram(
    acceptance: Mapping[str, Mapping[str, PairAcceptance]],
    rows: Sequence[Mapping],
    title: str,
    path: Path,
) -> Path | None:
    """Share of verifications that accepted 0, 1, 2, ... draft tokens: one panel per stage pair,
    one bar per method. ``acceptance``: method -> pair -> ``metrics.acceptance``."""
    methods = [m for m, pairs in acceptance.items() if any(a.verifications for a in pairs.values())]
    if not methods:
        return None
    pairs = list(dict.fromkeys(p for m in methods for p in acceptance[m]))
    by_method = {r["method"]: r for r in rows}
    stage_models = next((r["stage_models"] for r in rows if r["method"] in methods), None)
    fig = Figure(figsize=(max(6.0, 5.0 * len(pairs)), 4.6), layout="constrained")
    axes = fig.subplots(1, len(pairs), squeeze=False)[0]
    width = 0.8 / len(methods)
    for ax, pair in zip(axes, pairs, strict=True):
        longest = max(len(a.accepted_histogram) if (a := acceptance[m].get(pair)) else 0 for m in methods)
        for j, m in enumerate(methods):
            a = acceptance[m].get(pair)
            if not a or not a.verifications:
                continue
            hist = a.accepted_histogram
            xs = [k + (j - (len(methods) - 1) / 2) * width for k in range(len(hist))]
            ys = [100 * h / a.verifications for h in hist]
            label = (
                f"{_method_label(by_method.get(m), m)}: {a.verifications} verifications, "
                f"mean {a.mean_accepted:.2f}"
            )
            ax.bar(xs, ys, width=width, color=METHOD_COLORS.get(m), label=label)
        i, k = (int(s) for s in pair.split("->"))
        names = f"\n{stage_models[i]} -> {stage_models[k]}" if stage_models and k < len(stage_models) else ""
        ax.set_title(f"stage pair {pair}{names}", fontsize=10)
        ax.set_xlabel("draft tokens accepted per verification (tokens)")
        ax.set_ylabel("share of verifications (%)")
        ax.set_xticks(range(max(longest, 1)))
        ax.set_xlim(-0.6, max(longest, 1) - 0.4)
        ax.grid(axis="y", alpha=0.3)
        if ax.containers:
            ax.legend(fontsize=8, loc="upper right")
        else:
            ax.text(0.5, 0.5, "no verifications at this pair\n(the verifier only took own steps)",
                    ha="center", va="center", transform=ax.transAxes, fontsize=9)  # fmt: skip
            ax.set_ylim(0, 100)
            ax.set_xticks([])
    fig.suptitle(f"Accepted tokens per verification ({title})")
    return _save(fig, path)


# --------------------------------------------------------------------------------------------
# paper Figs. 2 / 5


def timeline(records: Mapping[str, Record], title: str, path: Path) -> Path | None:
    """Gantt chart of one prompt: one panel per method, one row per stage, bars by event kind;
    ticks on the last stage's row mark when tokens were committed."""
    if not records:
        return None
    n_stages = [len(r.stages) for r in records.values()]
    fig = Figure(figsize=(11.0, 1.3 + sum(0.55 * n + 0.9 for n in n_stages)), layout="constrained")
    axes = fig.subplots(len(records), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": n_stages})[
        :, 0
    ]
    kinds_seen: set[str] = set()
    for ax, (method, rec) in zip(axes, records.items(), strict=True):
        stages = rec.stages
        for s, st in enumerate(stages):
            # waits first, compute on top (a wait may be logged up to the end of the next step)
            for kind in sorted({e[2] for e in st.timeline}, key=lambda k: k != "wait"):
                spans = [(1000 * e[0], max(1000 * (e[1] - e[0]), 0.0)) for e in st.timeline if e[2] == kind]
                ax.broken_barh(
                    spans, (s - 0.38, 0.76), facecolors=KIND_COLORS.get(kind, "#999999"),
                    linewidth=0, zorder=1 if kind == "wait" else 2,
                )  # fmt: skip
                kinds_seen.add(kind)
        commits = stages[-1].commit_times
        if commits:
            ax.scatter(
                [1000 * t for t, _ in commits], [len(stages) - 1 + 0.5] * len(commits),
                marker="v", s=14, color="black", zorder=3, linewidths=0,
            )  # fmt: skip
        ax.set_yticks(range(len(stages)))
        ax.set_yticklabels(
            [f"stage {st.stage} (rank {st.rank})\n{st.model}" for st in stages],
            fontsize=8,
        )
        ax.set_ylim(len(stages) - 0.35, -0.55)
        ax.grid(axis="x", alpha=0.3)
        la = rec.window
        la_txt = "" if method == "ar" or la is None else f", window {la}"
        ax.set_title(
            f"{method}{la_txt}: {rec.n_new_tokens} tokens in {1000 * rec.wall_s:.0f} ms "
            f"({rec.ms_per_token:.1f} ms/token)",
            fontsize=10, loc="left",
        )  # fmt: skip
    axes[-1].set_xlabel("time since the rank's prompt start (ms)")
    handles = [Patch(color=KIND_COLORS[k], label=KIND_LABELS[k]) for k in KIND_COLORS if k in kinds_seen]
    handles.append(
        Line2D([], [], marker="v", color="black", linestyle="", label="tokens committed (last stage)")
    )
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8)
    prompt = next(iter(records.values())).prompt_id
    fig.suptitle(f"Per-stage timeline of prompt {prompt} ({title})")
    return _save(fig, path)


# --------------------------------------------------------------------------------------------
# busy fraction (paper: GPU utilisation)


def busy_fraction(rows: Sequence[Mapping], title: str, path: Path) -> Path | None:
    """Per stage, the share of the wall time spent computing (prefill, drafts, verifications,
    own steps): one group of bars per table row (method), one bar per stage."""
    rows = [r for r in rows if r.get("busy_fraction")]
    if not rows:
        return None
    n_st = max(len(r["busy_fraction"]) for r in rows)
    names = {tuple(r["stage_models"]) for r in rows}
    same = len(names) == 1
    with_run = len({r["run"] for r in rows}) > 1
    fig = Figure(figsize=(max(6.5, 1.1 * len(rows) * max(n_st, 2) / 2 + 3), 4.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / n_st
    top = 0.0
    for s in range(n_st):
        xs, ys = [], []
        for i, r in enumerate(rows):
            if s < len(r["busy_fraction"]):
                xs.append(i + (s - (n_st - 1) / 2) * width)
                ys.append(100 * r["busy_fraction"][s])
        label = f"stage {s}: {rows[0]['stage_models'][s]}" if same else f"stage {s}"
        bars = ax.bar(xs, ys, width=width, color=STAGE_COLORS[s % len(STAGE_COLORS)], label=label)
        if len(rows) * n_st <= 40:
            ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
        top = max([top, *ys])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([_row_label(r, with_run) for r in rows], fontsize=8)
    ax.set_ylabel("busy fraction of the prompt's wall time (%)")
    ax.set_xlabel("method")
    ax.set_ylim(0, max(100.0, top * 1.12))
    ax.axhline(100, color="black", linewidth=0.6, alpha=0.4)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"Busy fraction per stage ({title})")
    return _save(fig, path)


# --------------------------------------------------------------------------------------------
# paper Fig. 4


def speedup_vs_lookahead(
    sweeps: Mapping[str, Sequence[Mapping]], ar_ms: Mapping[str, float], path: Path
) -> Path | None:
    """Speedup over AR and ms/token against the lookahead, one line per (method, models);
    several runs at one lookahead are averaged on the line and shown as points."""
    if not sweeps:
        return None
    fig = Figure(figsize=(12.0, 4.8), layout="constrained")
    ax_s, ax_ms = fig.subplots(1, 2)
    targets = set()
    for n, (label, rows) in enumerate(sweeps.items()):
        color = STAGE_COLORS[(2 * n + 1) % len(STAGE_COLORS)]
        if rows[0]["method"] in METHOD_COLORS and len(sweeps) <= 2:
            color = METHOD_COLORS[rows[0]["method"]]
        targets.add(rows[0]["target"])
        for ax, key in ((ax_s, "speedup"), (ax_ms, "ms_per_token")):
            pts = [(r["window"], r[key]) for r in rows if r[key] is not None]
            if not pts:
                continue
            xs = sorted({x for x, _ in pts})
            means = [sum(y for x, y in pts if x == v) / sum(1 for x, _ in pts if x == v) for v in xs]
            ax.plot(xs, means, marker="o", color=color, label=label)
            if len(pts) > len(xs):
                ax.scatter(
                    *zip(*pts, strict=True), color=color, alpha=0.4, s=14,
                    label=f"{label}: single runs (line: their mean)",
                )  # fmt: skip
    ax_s.axhline(1.0, color="black", linestyle="--", linewidth=1, label="AR (1.0x)")
    for t in sorted(targets):
        if t in ar_ms:
            ax_ms.axhline(
                ar_ms[t], color="black", linestyle="--", linewidth=1,
                label=f"AR {t}: {ar_ms[t]:.2f} ms/token",
            )  # fmt: skip
    ax_s.set_ylabel("speedup over AR (x)")
    ax_ms.set_ylabel("decode time (ms/token)")
    ax_s.set_title("Speedup over AR of the same target (higher is better)", fontsize=10)
    ax_ms.set_title("Time per token (lower is better)", fontsize=10)
    for ax in (ax_s, ax_ms):
        ax.set_xlabel("window (draft tokens a verifier waits for: SD's window, PipeSpec's lookahead)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Lookahead sweep (cf. paper Fig. 4)")
    return _save(fig, path)


# --------------------------------------------------------------------------------------------
# batched decoding


def throughput_vs_batch(sweeps: Mapping[str, Sequence[Mapping]], title: str, path: Path) -> Path | None:
    """Tokens/s (throughput) and each sequence's own ms/token (p50, latency) against the batch
    size, one line per (method, models): where the speculative lines cross batched AR's is
    where speculation stops paying."""
    if not sweeps:
        return None
    fig = Figure(figsize=(12.0, 4.8), layout="constrained")
    ax_t, ax_l = fig.subplots(1, 2)
    sizes: set[int] = set()
    for n, (label, rows) in enumerate(sweeps.items()):
        method = rows[0]["method"]
        color = METHOD_COLORS.get(method) if len(sweeps) <= 3 else STAGE_COLORS[n % len(STAGE_COLORS)]
        xs = [r["batch_size"] for r in rows]
        sizes.update(xs)
        ax_t.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", color=color, label=label)
        for q, marker, style in (("p50", "o", "-"), ("p90", "x", ":")):
            pts = [(r["batch_size"], r["sequence_ms_per_token"].get(q)) for r in rows]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax_l.plot(*zip(*pts, strict=True), marker=marker, linestyle=style, color=color,
                          alpha=1.0 if q == "p50" else 0.7, label=f"{label}: {q}")  # fmt: skip
    ax_t.set_ylabel("throughput (tokens/s, all sequences)")
    ax_l.set_ylabel("latency (ms/token of each sequence)")
    ax_t.set_title("Throughput (higher is better)", fontsize=10)
    ax_l.set_title("Per-sequence latency (lower is better)", fontsize=10)
    for ax in (ax_t, ax_l):
        ax.set_xlabel("batch size (sequences in flight per stage)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(sizes))
        ax.set_xticklabels([str(b) for b in sorted(sizes)])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Batched decoding ({title})")
    return _save(fig, path)


def simulator_fit(rows: Sequence[Mapping], path: Path) -> Path:
    """Simulated vs measured ms/token, one point per (run, method), with the +-15% band."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig = Figure(figsize=(5.5, 5))
    ax = fig.add_subplot()
    xs = [r["measured_ms_per_token"] for r in rows]
    lo, hi = min(xs) * 0.7, max(xs) * 1.4
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [0.85 * lo, 0.85 * hi], [1.15 * lo, 1.15 * hi], color="0.9", label="+-15%")
    for m, c in METHOD_COLORS.items():
        sel = [r for r in rows if r["method"] == m]
        if sel:
            ax.scatter([r["measured_ms_per_token"] for r in sel], [r["predicted_ms_per_token"] for r in sel],
                       color=c, label=m, zorder=3, s=28)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("measured ms/token")
    ax.set_ylabel("simulated ms/token")
    ax.set_title("Simulator vs runs of this project (CPU)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return _save(fig, path)
