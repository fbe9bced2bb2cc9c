"""CLI command groups; each module's functions parse options and call the API."""
from __future__ import annotations

import json
import math
from typing import Any


def finite_json(v: Any) -> Any:
    """Non-finite floats as the strings "inf", "-inf", "nan" (strict JSON has no such numbers)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else "inf" if v > 0 else "-inf"
    if isinstance(v, dict):
        return {str(k): finite_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite_json(x) for x in v]
    return v


def print_json(doc: Any) -> None:
    """One strict JSON document on stdout (--json of every command); other objects as their str()."""
    print(json.dumps(finite_json(doc), indent=1, allow_nan=False, default=str))
