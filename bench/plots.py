"""The Benchmarks pages' pictures, drawn from the result files where a curve says more than a
table: memory and time against the GRPO group size G, time and efficiency against the TP size,
a smoke run's reward and rollout-vs-training drift per step, and a GPU's clock and power over a
run.

``plot_names`` decides which result gets which picture from the data alone (standard library:
the pages name their pictures without drawing them); ``draw`` draws one with matplotlib (the
``docs`` extra).
"""

from __future__ import annotations

from pathlib import Path

from .schema import card_slug, payload

__all__ = ["draw", "plot_kind", "plot_name", "plot_names"]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _smoke_series(body: dict) -> dict[str, dict]:
    """``{run name: per-step columns}`` of a smoke report (one run) or of a file of runs."""
    if isinstance(body.get("per_step"), dict) and isinstance(body["per_step"].get("max_abs_delta"), list):
        return {"run": body["per_step"]}
    runs = body.get("runs")
    if isinstance(runs, dict):
        return {name: r["per_step"] for name, r in runs.items()
                if isinstance(r, dict) and isinstance(r.get("per_step"), dict)
                and isinstance(r["per_step"].get("max_abs_delta"), list)}
    return {}


def plot_kind(data: dict) -> str | None:
    """Which picture a result gets, if any: ``group_size``, ``tp``, ``smoke`` or ``power``."""
    body = payload(data)
    if data["op"] == "group_memory" and len(body.get("rows") or []) >= 2:
        return "group_size"
    if data["op"] == "tp" and data["card"] != "cpu" and any(
            len(s.get("tp") or {}) >= 2 for s in (body.get("by_shape") or {}).values()):
        return "tp"
    if any(len(s["max_abs_delta"]) >= 2 for s in _smoke_series(body).values()):
        return "smoke"
    if isinstance(body.get("samples"), dict) and any("clocks" in k for k in body["samples"]):
        return "power"
    return None


def plot_name(rel: str, data: dict) -> str:
    """``<op>-<card slug>-<day>-<label>.png``: one picture per result."""
    return f"{data['op']}-{card_slug(data['card'])}-{rel.rsplit('/', 1)[-1].removesuffix('.json')}.png"


def plot_names(results: dict[str, dict]) -> dict[str, str]:
    """``{result path: picture file name}`` for every result that gets a picture."""
    return {rel: plot_name(rel, data) for rel, data in results.items() if plot_kind(data)}


# --------------------------------------------------------------------------- drawing


def _group_size(body, fig):
    rows = body["rows"]
    peers = list(dict.fromkeys(p for r in rows for p in r["peers"]))
    mem, ms = fig.subplots(1, 2)
    for peer in peers:
        pts = [(r["G"], r["peers"][peer]) for r in rows if peer in r["peers"]]
        mem_pts = [(g, p["above_grads_gib"]) for g, p in pts if _number(p.get("above_grads_gib"))]
        ms_pts = [(g, p["ms"]) for g, p in pts if _number(p.get("ms"))]
        if mem_pts:
            mem.plot(*zip(*mem_pts), marker="o", label=peer)
        if ms_pts:
            ms.plot(*zip(*ms_pts), marker="o", label=peer)
    shape = body.get("shape") or {}
    sizes = [r["G"] for r in rows]
    for ax, what in ((mem, "memory above the gradients (GiB)"), (ms, "forward + backward (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(g) for g in sizes])
        ax.set_yscale("log")
        ax.set_xlabel(f"group size G ({shape.get('seq', '?')} scored tokens per answer)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    mem.legend(fontsize=7)
    fig.suptitle(f"log-probs + GRPO loss against G, V {shape.get('V', '?'):,}, H {shape.get('H', '?')}", fontsize=9)


def _tp(body, fig):
    shapes = [(name, s) for name, s in body["by_shape"].items() if len(s.get("tp") or {}) >= 2]
    axes = fig.subplots(2, len(shapes), squeeze=False)
    for col, (name, s) in enumerate(shapes):
        sizes = sorted(s["tp"], key=int)
        peers = list(dict.fromkeys(p for t in sizes for p in (s["tp"][t].get("timings") or {}) if p.endswith("_tp")))
        for peer in peers:
            pts = [(int(t), s["tp"][t]["timings"][peer]) for t in sizes if peer in (s["tp"][t].get("timings") or {})]
            axes[0][col].plot([t for t, _ in pts], [e["ms"] for _, e in pts], marker="o", label=peer.removesuffix("_tp"))
            eff = [(t, e["efficiency_vs_tp1"]) for t, e in pts if _number(e.get("efficiency_vs_tp1"))]
            if eff:
                axes[1][col].plot(*zip(*eff), marker="o", label=peer.removesuffix("_tp"))
        axes[0][col].set_title(f"{name}: N {s['N']:,}, H {s['H']}, V {s['V']:,}", fontsize=8)
        axes[0][col].set_ylabel("forward + backward (ms)")
        axes[1][col].set_ylabel("efficiency t(1) / (tp · t(tp))")
        axes[1][col].set_ylim(0, 1.1)
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xticks([int(t) for t in sizes], [str(t) for t in sizes])
            ax.set_xlabel("tp size")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)


def _smoke(body, fig):
    series = _smoke_series(body)
    reward, drift = fig.subplots(2, 1, sharex=True)
    for name, s in series.items():
        steps = s.get("step") or list(range(1, len(s["max_abs_delta"]) + 1))
        values = [v if _number(v) else float("nan") for v in s["max_abs_delta"]]
        zero = all(v == 0 for v in values)
        label = ("0 at every step" if zero else "") if name == "run" else name + (" (0 at every step)" if zero else "")
        if isinstance(s.get("reward_mean"), list):
            reward.plot(steps, s["reward_mean"], linewidth=1, label=label or None)
        drift.plot(steps, values, linewidth=2.5 if zero else 1, label=label or None)
    reward.set_ylabel("mean reward")
    reward.grid(True, alpha=0.3)
    drift.set_yscale("symlog", linthresh=1e-7)
    drift.set_ylim(bottom=0)
    drift.set_ylabel("max |Δ| rollout vs training")
    drift.set_xlabel("GRPO step")
    drift.grid(True, alpha=0.3)
    if len(series) > 1 or any(line.get_label() and not line.get_label().startswith("_") for line in drift.lines):
        drift.legend(fontsize=7)


def _power(body, fig):
    samples = body["samples"]
    clock = next(v for k, v in samples.items() if "clocks" in k)
    power = next((v for k, v in samples.items() if "power" in k), None)
    t = [i * 0.25 for i in range(len(clock))]
    ax = fig.subplots()
    ax.plot(t, clock, color="#1b9e77", linewidth=1)
    ax.set_xlabel("seconds (one sample every 250 ms)")
    ax.set_ylabel("SM clock (MHz)", color="#1b9e77")
    ax.grid(True, alpha=0.3)
    if power:
        ax2 = ax.twinx()
        ax2.plot(t, power, color="#d95f02", linewidth=1)
        ax2.set_ylabel("power (W)", color="#d95f02")


_DRAW = {"group_size": (_group_size, (8, 3.4)), "tp": (_tp, (8, 5.5)), "smoke": (_smoke, (8, 4.5)),
         "power": (_power, (8, 3))}


def draw(data: dict, path: Path | str) -> Path:
    """Draw ``data``'s picture (``plot_kind``) into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind = plot_kind(data)
    if kind is None:
        raise ValueError(f"{data['op']} / {data['label']} gets no picture")
    fn, size = _DRAW[kind]
    with plt.style.context("default"):
        fig = plt.figure(figsize=size, dpi=90, layout="constrained")
        try:
            fn(payload(data), fig)
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, metadata={"Software": None})
        finally:
            plt.close(fig)
    return path
