"""The server with regions left out, as `python actae.py` otherwise:

    ACTAE_WITHOUT_REGIONS=fleet,experiments python tests/without_regions.py --port 0 --data-dir DIR

It imports actae and calls `actae.main(regions=...)` with every declared region but the ones named,
so test_regions.py can check that the kernel and the other regions serve without them.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import actae  # noqa: E402

VARIABLE = "ACTAE_WITHOUT_REGIONS"


def regions_kept(text: str) -> list:
    named = set(filter(None, (part.strip() for part in text.split(","))))
    unknown = sorted(named - {region.name for region in actae.REGIONS})
    if unknown:
        raise SystemExit(f"without_regions: no region is named {', '.join(unknown)}")
    return [region for region in actae.REGIONS if region.name not in named]


if __name__ == "__main__":
    sys.exit(actae.main(regions=regions_kept(os.environ.get(VARIABLE, ""))))
