"""The invariance sweep's report: per case and mode, bitwise or not, by how much, and where
drift starts; as a table, JSON, and a PNG of the first differing module."""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

from ..schema import Choice
from ..schema.checks import bool_arg, float_arg, int_arg

__all__: list[str] = []


class Mode(Choice):
    """The kernels a sweep scores under."""

    BATCH_INVARIANT = "batch_invariant"
    DEFAULT = "default"  # the model's own kernels: the control


@dataclass
class Divergence:
    """Where two runs first differ for one sample."""

    sample: int
    module: str  # e.g. "model.language_model.layers.0.self_attn.q_proj"; "lm_head" when only scores differ
    op: str  # the module's class, e.g. "Linear"
    max_abs_diff: float
    order: int  # index of the module in model.named_modules() (len of it for the LM head)
    modules_compared: int


@dataclass
class CaseResult:
    case: str
    detail: str
    mode: str  # "batch_invariant" or "default"
    bitwise: bool
    max_abs_diff: float
    tokens: int
    divergence: Optional[Divergence] = None


@dataclass
class InvarianceReport:
    results: list[CaseResult]
    meta: dict = field(default_factory=dict)

    @property
    def invariant(self) -> bool:
        """True when every case under batch_invariant() was bitwise equal (and there was one)."""
        rows = [r for r in self.results if r.mode == Mode.BATCH_INVARIANT]
        return bool(rows) and all(r.bitwise for r in rows)

    def to_dict(self) -> dict:
        return {"meta": self.meta, "invariant": self.invariant, "results": [asdict(r) for r in self.results]}

    @classmethod
    def from_dict(cls, data: dict) -> "InvarianceReport":
        """The report ``to_dict`` wrote (e.g. to re-draw a saved run's chart), every field checked."""
        if not isinstance(data, dict):
            raise TypeError(f"data must be a dict (what InvarianceReport.to_dict wrote), got {type(data).__name__}")
        if not isinstance(data.get("results"), list):
            raise ValueError("data has no 'results' list (what InvarianceReport.to_dict wrote)")
        if not data["results"]:
            raise ValueError("data['results'] is empty: a sweep's report holds at least one result")
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise TypeError(f"data['meta'] must be a dict, got {type(meta).__name__}")
        results = []
        for i, r in enumerate(data["results"]):
            r = _fields_of(CaseResult, r, f"results[{i}]")
            r["mode"] = Mode.parse(r["mode"], f"results[{i}].mode").value
            r["bitwise"] = bool_arg(f"results[{i}].bitwise", r["bitwise"])
            r["max_abs_diff"] = float_arg(f"results[{i}].max_abs_diff", r["max_abs_diff"], min=0)
            r["tokens"] = int_arg(f"results[{i}].tokens", r["tokens"], min=0)
            if r["divergence"] is not None:
                d = _fields_of(Divergence, r["divergence"], f"results[{i}].divergence")
                for name in ("sample", "order", "modules_compared"):
                    d[name] = int_arg(f"results[{i}].divergence.{name}", d[name], min=0)
                d["max_abs_diff"] = float_arg(f"results[{i}].divergence.max_abs_diff", d["max_abs_diff"], min=0)
                r["divergence"] = Divergence(**d)
            results.append(CaseResult(**r))
        return cls(results, meta)

    def save_json(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def __str__(self) -> str:
        """The table ``rlk-mm invariance`` prints (``print(report)``); ``repr`` keeps the fields."""
        return self.table()

    def table(self) -> str:
        """One row per case and mode: bitwise or not, the max |diff|, the tokens compared and where drift starts."""
        head = f"{'case':<18} {'detail':<22} {'mode':<16} {'bitwise':<8} {'max |diff|':>11} {'tokens':>6}  drift starts at"
        lines = [head, "-" * len(head)]
        for r in self.results:
            where = "" if r.divergence is None else f"{r.divergence.module} ({r.divergence.op})"
            lines.append(f"{r.case:<18} {r.detail:<22} {r.mode:<16} {'yes' if r.bitwise else 'NO':<8} "
                         f"{r.max_abs_diff:>11.3e} {r.tokens:>6}  {where}")
        return "\n".join(lines)

    def save_png(self, path) -> Path:
        """Two panels: max |diff| per case and mode; and for drifting cases, the module where drift starts."""
        if not self.results:
            raise ValueError("the report has no results to draw")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = list(dict.fromkeys((r.case, r.detail) for r in self.results))  # the sweep's order
        names = [f"{c} {d}".strip() for c, d in labels]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 0.45 * len(labels) + 2.2), sharey=True)
        y = range(len(labels))
        floor = 1e-12
        for k, (mode, colour) in enumerate((("batch_invariant", "tab:green"), ("default", "tab:red"))):
            vals = []
            for key in labels:
                hit = [r for r in self.results if (r.case, r.detail) == key and r.mode == mode]
                vals.append(max(hit[0].max_abs_diff, floor) if hit else float("nan"))
            ax1.barh([i + (0.2 if k else -0.2) for i in y], vals, height=0.4, color=colour, label=mode, log=True)
        ax1.axvline(floor, color="grey", lw=0.8)
        ax1.set_yticks(list(y), names)
        ax1.invert_yaxis()
        ax1.set_xlabel(f"max |Δ| vs reference (bars at {floor:g} = bitwise equal)")
        # above the bars, outside the axes: inside, it covers the bars of the last cases
        ax1.legend(loc="lower left", bbox_to_anchor=(0, 1.01), ncol=2, frameon=False, borderaxespad=0)
        stages = self.meta.get("module_order", [])
        for i, key in enumerate(labels):
            for r in self.results:
                if (r.case, r.detail) == key and r.divergence is not None:
                    colour = "tab:green" if r.mode == "batch_invariant" else "tab:red"
                    ax2.scatter([r.divergence.order], [i], color=colour, s=40)
                    ax2.annotate(r.divergence.module.replace("model.", ""), (r.divergence.order, i),
                                 fontsize=7, xytext=(4, 3), textcoords="offset points")
        if stages:
            starts = [j for j in range(len(stages)) if _stage(stages[j]) and (j == 0 or _stage(stages[j]) != _stage(stages[j - 1]))]
            every = max(1, len(starts) // 16)
            ticks = starts[::every] + [len(stages)]
            ax2.set_xticks(ticks, [_stage(stages[j]) for j in ticks[:-1]] + ["LM head"], rotation=45, ha="right", fontsize=7)
            ax2.set_xlim(-1, len(stages) + 2)
        ax2.set_xlabel("first module whose output differs (execution order)")
        ax2.set_title("where drift starts")
        fig.suptitle(f"invariance sweep: {self.meta.get('model', '')} {self.meta.get('device', '')} "
                     f"{self.meta.get('dtype', '')}, score={self.meta.get('score', '')}")
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _fields_of(kind: type, value, where: str) -> dict:
    """``value``, a dict of the dataclass ``kind``'s fields (those with defaults may be absent),
    its str fields checked."""
    if not isinstance(value, dict):
        raise TypeError(f"{where} must be a dict, got {type(value).__name__}")
    known = {f.name: f for f in fields(kind)}
    unknown = [k for k in value if k not in known]
    if unknown:
        raise ValueError(f"{where} has unknown field {unknown[0]!r}; a {kind.__name__} has {list(known)}")
    out = {name: f.default for name, f in known.items() if f.default is not MISSING}
    out.update(value)
    missing = [name for name in known if name not in out]
    if missing:
        raise ValueError(f"{where} is missing {missing[0]!r}")
    for name, f in known.items():
        if f.type == "str" and not isinstance(out[name], str):
            raise TypeError(f"{where}.{name} must be a str, got {type(out[name]).__name__}")
    return out


def _stage(name: str) -> str:
    """A coarse label of where a module sits (vision block k, merger, LM layer k), or ''."""
    parts = name.split(".")
    for key, label in (("blocks", "vision block "), ("layers", "LM layer ")):
        if key in parts and parts.index(key) + 1 < len(parts):
            return label + parts[parts.index(key) + 1]
    return "merger" if "merger" in parts else ""
