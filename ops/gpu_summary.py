"""The end of ops/gpu-check.sh: a short summary of its parts, printed and written as JSON.

    python ops/gpu_summary.py RESULTS NAME STATUS SECONDS [NAME STATUS SECONDS ...]

Reads what the parts left in RESULTS (pytest.xml, decode_bandwidth.json), writes
RESULTS/summary.json, and exits 1 if any part's exit status was not 0.
"""

from __future__ import annotations

import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def versions() -> dict:
    import torch
    import transformers

    try:
        import cupy
    except ImportError:  # gpu-check --dry-run goes on without it
        cupy = None

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cupy": cupy and cupy.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def pytest_counts(path: Path) -> dict | None:
    """Totals from a JUnit XML report, or None when pytest wrote none (killed, crashed)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["seconds"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    return counts


def bandwidth_report(path: Path) -> dict | None:
    """decode_bandwidth.py's JSON line, or None when it wrote none."""
    try:
        return json.loads(path.read_text().strip().splitlines()[-1])
    except (OSError, IndexError, ValueError):
        return None


def main(argv: list[str]) -> int:
    results = Path(argv[0])
    parts = {name: {"status": int(status), "seconds": int(seconds)}
             for name, status, seconds in zip(argv[1::3], argv[2::3], argv[3::3], strict=True)}  # fmt: skip
    if "pytest" in parts:
        parts["pytest"]["counts"] = pytest_counts(results / "pytest.xml")
    if "decode_bandwidth" in parts:
        parts["decode_bandwidth"]["report"] = bandwidth_report(results / "decode_bandwidth.json")
    ok = all(part["status"] == 0 for part in parts.values())
    summary = {"ok": ok, "versions": versions(), "parts": parts}
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    v = summary["versions"]
    print(f"gpu-check summary: {v['device'] or 'no CUDA device'}; python {v['python']}, "
          f"torch {v['torch']} (CUDA {v['cuda']}), cupy {v['cupy']}, transformers {v['transformers']}")  # fmt: skip
    for name, part in parts.items():
        description = describe(name, part)
        print(f"  {name}: exit {part['status']} in {part['seconds']} s" + (f"; {description}" if description else ""))
    print(f"  {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def describe(name: str, part: dict) -> str:
    if name == "pytest":
        c = part["counts"]
        if c is None:
            return "no report (killed by the time limit, or crashed)"
        return f"{c['passed']} passed, {c['failures'] + c['errors']} failed, {c['skipped']} skipped"
    if name == "decode_bandwidth":
        r = part["report"]
        if r is None:
            return "no report"
        share, target = r["kernel_share_of_peak"], r["shape"]["target"]
        return (f"{r['kernel_gbps']} GB/s = {share:.0%} of peak {r['peak_gbps']} GB/s (target {target:.0%}); "
                f"SDPA on gathered K/V {r['sdpa_gathered_gbps']} GB/s")  # fmt: skip
    return ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
