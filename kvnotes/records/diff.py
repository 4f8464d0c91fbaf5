"""What changed between two records of one probe, beyond float tolerance (a speed-up must leave its
records as they were: ``kvnotes battery --compare DIR``).

Only the ``result`` block is compared; wall times inside it (keys with a word ``ms``, ``seconds``,
``time``, ``timing``, ``ttft`` or ``cum`` (cumulative time), or ending in ``_s`` or ``_s_mean``:
``agent_ms``, ``oracle_ms_total``, ``time_ratio``, ``full_seconds``, ``setup_s``, ``full_s_mean``,
``cum_ttft_ratio``, a ``time`` block; not ``s_old`` or ``cumulative_length``) are skipped. Numbers match when ``|a - b| <= atol + rtol * |b|``;
every other leaf (strings, booleans, integers such as token ids, list lengths, keys) must be equal.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

#: Default tolerances of :func:`result_diff`: fp32 summation-order noise through a forward, with
#: headroom for ratios (recovery) and sums over rows.
RECORD_ATOL = 1e-3
RECORD_RTOL = 1e-3


#: A key naming a wall time or a ratio of wall times (``agent_ms``, ``oracle_ms_total``, ``time_ratio``,
#: ``full_seconds``, ``timing``, ``ttft``, ``cum_full``, ``prefill_s_mean``).
_TIMING = re.compile(r"(^|_)(ms|seconds|time|timing|ttft|cum)(_|$)|_s(_mean)?$")


def _timing_key(key: str) -> bool:
    return bool(_TIMING.search(key))


@dataclass
class RecordDiff:
    """Outcome of :func:`result_diff`.

    Attributes:
        n_numbers: float leaves compared.
        max_abs: the largest ``|a - b|`` over them, and where (``max_path``).
        mismatches: ``"path: a != b"`` for every leaf beyond tolerance or unequal.
    """

    n_numbers: int = 0
    max_abs: float = 0.0
    max_path: str = ""
    mismatches: list[str] = field(default_factory=list)

    def summary(self, limit: int = 5) -> str:
        """One line: numbers compared, the largest difference, the mismatches (first ``limit``)."""
        head = f"{self.n_numbers} numbers, max |diff| {self.max_abs:.1e}" + (f" at {self.max_path}" if self.max_path else "")
        if not self.mismatches:
            return head + ", nothing beyond tolerance"
        more = f" (+{len(self.mismatches) - limit} more)" if len(self.mismatches) > limit else ""
        return head + f", {len(self.mismatches)} beyond tolerance: " + "; ".join(self.mismatches[:limit]) + more


def result_diff(a: Any, b: Any, atol: float = RECORD_ATOL, rtol: float = RECORD_RTOL) -> RecordDiff:
    """Compare two ``result`` blocks (or whole records: their ``result`` is taken) leaf by leaf.

    Args:
        a: the new result. b: the reference result.
        atol, rtol: tolerances for float leaves (:data:`RECORD_ATOL`, :data:`RECORD_RTOL`).
    """
    if isinstance(a, dict) and isinstance(b, dict) and "result" in a and "result" in b:
        a, b = a["result"], b["result"]
    out = RecordDiff()
    _walk(a, b, "result", atol, rtol, out)
    return out


def _walk(a: Any, b: Any, path: str, atol: float, rtol: float, out: RecordDiff) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            out.mismatches.append(f"{path}: keys {sorted(set(a) ^ set(b))[:4]} differ")
        for k in a.keys() & b.keys():
            if not _timing_key(str(k)):
                _walk(a[k], b[k], f"{path}.{k}", atol, rtol, out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.mismatches.append(f"{path}: length {len(a)} != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{path}[{i}]", atol, rtol, out)
    elif isinstance(a, float) or isinstance(b, float):
        if not (isinstance(a, (int, float)) and isinstance(b, (int, float))) or isinstance(a, bool) or isinstance(b, bool):
            out.mismatches.append(f"{path}: {a!r} != {b!r}")
            return
        if math.isnan(a) and math.isnan(b):
            return
        diff = abs(a - b)
        out.n_numbers += 1
        if diff > out.max_abs or math.isnan(diff):
            out.max_abs, out.max_path = diff, path
        if not diff <= atol + rtol * abs(b):
            out.mismatches.append(f"{path}: {a:.6g} != {b:.6g}")
    elif a != b:
        out.mismatches.append(f"{path}: {a!r} != {b!r}")
