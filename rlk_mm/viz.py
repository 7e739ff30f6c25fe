"""Pictures of batch layouts: each sample as a coloured strip of its spans."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from .counts import plural
from .schema import Modality, RLBatch
from .schema.batch import batch_arg
from .schema.checks import int_arg, sequence_arg

__all__ = ["draw_layout"]

COLOURS = {
    Modality.TEXT: "#c8c8c8",
    Modality.IMAGE: "#4c9be8",
    Modality.VIDEO: "#9b59b6",
    Modality.AUDIO: "#e67e22",
}
LOSS_COLOUR = "#e74c3c"


def draw_layout(batch: RLBatch, path, samples: Optional[Sequence[int]] = None, title: Optional[str] = None) -> Path:
    """Draw the chosen samples (indices into the batch; default: up to the first 16) as strips:
    modality spans on top, loss spans below. Written to ``path`` (its folder must exist)."""
    batch_arg("batch", batch)
    if samples is None:
        samples = list(range(min(batch.num_samples, 16)))
    else:
        samples = [int_arg(f"samples[{i}]", b, min=0, max=batch.num_samples - 1)
                   for i, b in enumerate(sequence_arg("samples", samples, "sample indices"))]
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a str (or None), got {type(title).__name__}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    longest = max((int(batch.seq_lengths()[b]) for b in samples), default=1)
    rows = max(len(samples), 1)  # an empty selection draws an empty strip
    # constrained layout keeps the legend (outside, below) clear of the axis label however many rows there are
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * max(rows, 2)), layout="constrained")
    for row, b in enumerate(samples):
        y = len(samples) - 1 - row
        for s in batch.modality_spans_of(b):
            ax.broken_barh([(s.start, len(s))], (y + 0.35, 0.5), facecolors=COLOURS[s.modality], edgecolor="white",
                           linewidth=0.3)
        for s in batch.loss_spans_of(b):
            ax.broken_barh([(s.start, len(s))], (y + 0.05, 0.25), facecolors=LOSS_COLOUR)
    ax.set_yticks([len(samples) - 1 - r + 0.5 for r in range(len(samples))])
    labels = []
    for b in samples:
        group = "" if batch.group_ids is None else f" g={batch.group_ids[b]}"
        labels.append(f"sample {b}{group}")
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlim(0, longest)
    ax.set_ylim(0, rows)
    ax.set_xlabel("token position")
    handles = [Patch(color=COLOURS[m], label=m.label) for m in (Modality.TEXT, Modality.IMAGE, Modality.VIDEO)]
    handles.append(Patch(color=LOSS_COLOUR, label="loss (scored targets)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8)
    ax.set_title(title or f"layout: {plural(batch.num_samples, 'sample')}, fingerprint {batch.processor_fingerprint[:12]}",
                 fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
