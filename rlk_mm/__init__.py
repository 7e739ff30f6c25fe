"""rlk_mm: multimodal RL operators with schema-first batch objects.

The public API: the batch schema (``RLBatch``, spans), the ops (``rlk_mm.ops``: selected
log-prob, losses, rewards, pack, ``batch_invariant``), the model runners
(``rlk_mm.models``) and the parity checks (``rlk_mm.parity``).
"""

from . import deprecations, models, ops  # noqa: F401 (deprecations installs the moved-module finder; models registers patches)
from .schema import (
    BatchFileError,
    CoordinateSystem,
    Modality,
    PaddingSide,
    RLBatch,
    SchemaError,
    Span,
    SpanTable,
    UnsupportedModalityError,
    processor_fingerprint,
)

__version__ = "0.1.0"

__all__ = [
    "BatchFileError", "CoordinateSystem", "Modality", "PaddingSide", "RLBatch", "SchemaError", "Span", "SpanTable",
    "UnsupportedModalityError",
    "models", "ops", "processor_fingerprint", "__version__",
]
