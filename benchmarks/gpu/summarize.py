"""Environment probe and summary for ``check.sh``: ``env`` prints what the machine has; ``summary`` merges
``selftest.json``, ``mfu.json``, ``fit.json`` and ``fit_offload.json`` (the fit with the model state on the host)
into ``summary.json`` with the self-test's verdicts on this device (its own stage, and the one each benchmark ran
first), the FPDT overhead over Ulysses and the state offload's cost at equal N.

    python benchmarks/gpu/summarize.py env
    python benchmarks/gpu/summarize.py summary OUTDIR --rc tests=0 selftest=0 mfu=0 fit=0 fit_offload=0
"""

from __future__ import annotations

import argparse
import importlib
import json
import runpy
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the testing helper's ``environment()`` as a file, for when the package itself does not import
RESULTS_PY = Path(__file__).resolve().parents[2] / "lightning_longctx" / "testing" / "results.py"


def probe() -> dict[str, Any]:
    """``environment()`` of ``lightning_longctx.testing`` (versions, GPU) and whether the package imports."""
    try:
        importlib.import_module("lightning_longctx")
        status = "ok"
    except Exception as e:
        status = f"FAILED: {type(e).__name__}: {e}"
    env = {**_environment(status == "ok")(), "executable": sys.executable}
    env["lightning_longctx_import"] = status
    return env


def _environment(package_imports: bool) -> Callable[[], dict[str, Any]]:
    """The helper's ``environment``: from the package, or, when the package does not import (what the probe is
    for), run from its file (it needs only the standard library and torch)."""
    if package_imports:
        from lightning_longctx.testing import environment

        return environment
    return runpy.run_path(str(RESULTS_PY))["environment"]


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def junit_counts(path: Path) -> dict[str, Any] | None:
    """Totals of a pytest junit XML, and the ids of failed tests and collection errors."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    bad = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            if case.find(kind) is not None:
                bad.append(f"{kind}: {case.get('classname')}::{case.get('name')}")
    totals["passed"] = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    totals["not_passed"] = bad[:30]
    return totals


#: per length of a fit: measured vs planned memory (``longctx.py add_plan``)
PLANNER_KEYS = (
    "seq_len",
    "max_allocated_gib",
    "planned_gib",
    "planner_error_pct",
    "max_reserved_gib",
    "device_in_use_gib",
    "planned_device_needed_gib",
    "device_needed_vs_reserved_pct",
    "device_needed_vs_in_use_pct",
    "host_offloaded_gib",
    "planned_host_gib",
    "max_rss_gib",
    "planned_host_needed_gib",
    "host_needed_vs_rss_pct",
    "planned_fits",
    "planned_binding",
    "activation_checkpointing",
)


def _ok_rows(data: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    return {r["seq_len"]: r for r in (data or {}).get("results", []) if r.get("status") == "ok"}


def state_offload_cost(
    fpdt: dict[int, dict[str, Any]], offload: dict[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    """At each N both fits ran: the device memory the state offload saves and the time it adds."""
    rows = []
    for n in sorted(set(fpdt) & set(offload)):
        f, o = fpdt[n], offload[n]
        saved = None
        if f.get("max_allocated_gib") is not None and o.get("max_allocated_gib") is not None:
            saved = round(f["max_allocated_gib"] - o["max_allocated_gib"], 2)
        rows.append(
            {
                "seq_len": n,
                "fpdt_offload_step_s": f["measured_step_s"],
                "state_offload_step_s": o["measured_step_s"],
                "overhead": round(o["measured_step_s"] / f["measured_step_s"] - 1.0, 3),
                "device_allocated_saved_gib": saved,
                "max_rss_gib": [f.get("max_rss_gib"), o.get("max_rss_gib")],
            }
        )
    return rows


#: per self-test: what ``summary.json`` keeps of it (``longctx.py run_self_test``)
SELF_TEST_KEYS = ("mode", "precision", "offload", "seq_len", "passed", "seconds", "probe", "checks", "error")


def self_tests(out: Path, benchmarks: dict[str, dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Every self-test the check ran: the ``selftest`` stage's runs, then the one each benchmark ran first."""
    runs = [{"stage": "selftest", **r} for r in (_load(out / "selftest.json") or {}).get("results", [])]
    runs += [
        {"stage": name, **data["self_test"]}
        for name, data in benchmarks.items()
        if data and "self_test" in data
    ]
    return [{"stage": r["stage"], **{k: r[k] for k in SELF_TEST_KEYS if k in r}} for r in runs]


def _self_test_line(r: dict[str, Any]) -> str:
    verdict = "passed" if r.get("passed") else "FAILED"
    checks = "; ".join(
        f"{c['dtype']}: "
        + ", ".join(f"{k} {v:.1e}" for k, v in c["errors"].items())
        + f" (tol {c['tolerance']:.0e})"
        for c in r.get("checks", [])
    )
    error = f"; {r['error'][:300]}" if r.get("error") else ""
    return f"  {r['stage']:<11} {r.get('mode')} {r.get('precision')}: {verdict} in {r.get('seconds')} s: {checks}{error}"


def summarize(out: Path, rc: dict[str, str]) -> dict[str, Any]:
    mfu, fit = _load(out / "mfu.json"), _load(out / "fit.json")
    fit_offload = _load(out / "fit_offload.json")
    ulysses, fpdt, state = _ok_rows(mfu), _ok_rows(fit), _ok_rows(fit_offload)
    overhead = []
    for n in sorted(set(ulysses) & set(fpdt)):
        u, f = ulysses[n], fpdt[n]
        overhead.append(
            {
                "seq_len": n,
                "ulysses_step_s": u["measured_step_s"],
                "fpdt_offload_step_s": f["measured_step_s"],
                "overhead": round(f["measured_step_s"] / u["measured_step_s"] - 1.0, 3),
                "ulysses_checkpointing": u.get("activation_checkpointing"),
                "fpdt_checkpointing": f.get("activation_checkpointing"),
                "fpdt_first_step_only": f.get("first_step_only"),
                "fpdt_chunk_size": f.get("chunk_size"),
            }
        )
    tests = self_tests(out, {"mfu": mfu, "fit": fit, "fit_offload": fit_offload})
    summary = {
        "environment": probe(),
        "stage_exit_codes": rc,
        "tests": junit_counts(out / "pytest.xml"),
        "self_test_passed": all(r.get("passed") for r in tests) if tests else None,
        "self_tests": tests,
        "mfu": [
            {
                k: r.get(k)
                for k in ("seq_len", "status", "mfu", "tflops", "tokens_per_sec", "activation_checkpointing")
            }
            for r in (mfu or {}).get("results", [])
        ],
        "sdpa_kernels": (mfu or {}).get("sdpa_kernels"),
        "fpdt_offload_largest_fit": (fit or {}).get("largest_fit"),
        "fpdt_offload_stopped_by": (fit or {}).get("stopped_by"),
        "fpdt_offload_estimated_limits": (fit or {}).get("estimated_limits"),
        "fpdt_activation_offload": (fit or {}).get("activation_offload"),
        "planner_vs_measured": [{k: r.get(k) for k in PLANNER_KEYS} for r in fpdt.values()],
        "fpdt_overhead_over_ulysses": overhead,
        # fit --cpu-offload: FSDP2 CPUOffloadPolicy, fp32 master weights on the host, bf16 compute
        "state_offload_largest_fit": (fit_offload or {}).get("largest_fit"),
        "state_offload_stopped_by": (fit_offload or {}).get("stopped_by"),
        "state_offload_estimated_limits": (fit_offload or {}).get("estimated_limits"),
        "state_offload_planner_vs_measured": [{k: r.get(k) for k in PLANNER_KEYS} for r in state.values()],
        "state_offload_cost": state_offload_cost(fpdt, state),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env")
    s = sub.add_parser("summary")
    s.add_argument("outdir", type=Path)
    s.add_argument("--rc", nargs="*", default=[], help="stage=exit_code pairs")
    args = p.parse_args(argv)
    if args.cmd == "env":
        print(json.dumps(probe(), indent=2))
        return 0
    summary = summarize(args.outdir, dict(kv.split("=", 1) for kv in args.rc))
    print(f"CUDA tests: {summary['tests']}")
    passed = summary["self_test_passed"]
    verdict = "none ran" if passed is None else "every run passed" if passed else "FAILED"
    print(f"self-test on this device: {verdict}")
    for r in summary["self_tests"]:
        print(_self_test_line(r))
    print("MFU (Ulysses, SDPA):")
    for r in summary["mfu"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        print(
            f"  N={r['seq_len']:>7}  {r['status']:<9} MFU {mfu:>6}  ckpt={r.get('activation_checkpointing')}"
        )
    print(
        f"FPDT+offload: largest N that ran {summary['fpdt_offload_largest_fit']} "
        f"(stopped by {summary['fpdt_offload_stopped_by']}); estimates {summary['fpdt_offload_estimated_limits']}"
    )
    for o in summary["fpdt_overhead_over_ulysses"]:
        print(f"FPDT overhead at N={o['seq_len']}: {100 * o['overhead']:+.0f}%  ({o})")
    print(
        f"FPDT+offload+state offload: largest N that ran {summary['state_offload_largest_fit']} "
        f"(stopped by {summary['state_offload_stopped_by']}); estimates {summary['state_offload_estimated_limits']}"
    )
    for r in summary["state_offload_planner_vs_measured"]:
        print(f"  planner at N={r['seq_len']}: {r}")
    for o in summary["state_offload_cost"]:
        print(f"state offload cost at N={o['seq_len']}: {100 * o['overhead']:+.0f}% time ({o})")
    print(f"stage exit codes: {summary['stage_exit_codes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
