"""Long randomized differential searches: the strategies of ``tests/test_fuzz.py``, many more trials.

    python benchmarks/fuzz.py --trials 2000 --seed 1                 # the attention core
    python benchmarks/fuzz.py --trials 300 --worlds 2 4 --seed 5     # only these world sizes (the ring drawn)
    python benchmarks/fuzz.py --trials 300 --worlds 2 4 --ring-only  # Ulysses x ring alone (ring_size > 1)
    python benchmarks/fuzz.py --target strategy --trials 50 --seed 1  # one Trainer step per trial
    python benchmarks/fuzz.py --target strategy --archs qwen3_5_text,mamba2 --trials 20   # only these models

(``benchmarks/fuzz.py`` runs this script, ``tests/fuzz_search.py``, with the same arguments: the search lives
beside the test modules it draws from, which import each other by name.)

Every trial is one drawn configuration run on real gloo ranks against the single-process reference
(``tests/fuzz_common.py``: exact / refused / failing; a dead rank or a hang is failing, with the ranks
named; a refusal is failing unless the target's table of documented refusals, ``EXPECTED_REFUSALS`` of
``fuzz_strategy`` / ``fuzz_attention``, names it for that configuration). The strategy target also draws the
evaluation callbacks (``PositionalLoss``, ``NeedleRetrieval``) in a validation run after the step: their metrics
must equal the reference's too. Prints a table of verdicts per mode and world size, the refusals by message with
the expected class each is (unexpected ones are failing), for the strategy target the distribution of the draws
(sp, ring, mode, offload, packed, hybrid, world, dp, tp), every failing configuration as a line ready to paste
into ``REGRESSIONS`` of tests/test_fuzz.py, and writes the JSON (``--out``: the counts, the distribution, the
refusals by message and every failing case).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from lightning_longctx.testing import environment, format_table, write_json

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _targets(
    archs: list[str] | None = None, worlds: list[int] | None = None, ring_only: bool = False
) -> dict:
    """name -> (strategy of cases, the per-rank runner, tolerance, timeout per trial in s, its documented
    refusals); ``archs``: the strategy target draws only these architectures; ``worlds``: the attention target
    only these world sizes, ``ring_only``: only Ulysses x ring (``ring_size > 1``)."""
    import fuzz_attention as attn
    import fuzz_strategy as strat

    worlds = [w for w in worlds or [1, 2, 4] if w > 1 or not ring_only]  # a ring needs two ranks
    attn_cases = attn.attention_cases(tuple(worlds), ring_only=ring_only)
    return {
        "attention": (attn_cases, attn.run_attention, attn.TOLERANCE, attn.TIMEOUT_S, attn.EXPECTED_REFUSALS),
        "strategy": (
            strat.strategy_cases(archs),
            strat.run_strategy,
            strat.TOLERANCE,
            strat.TIMEOUT_S,
            strat.EXPECTED_REFUSALS,
        ),
    }


def search(
    target: str,
    trials: int,
    seed: int,
    quiet: bool = False,
    archs: list[str] | None = None,
    worlds: list[int] | None = None,
    ring_only: bool = False,
) -> list[dict]:
    """Run ``trials`` drawn cases (hypothesis, seeded, no shrinking, no database); one row per trial."""
    from fuzz_common import run_verdict
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from lightning_longctx.testing import WarmPools

    cases, runner, tolerance, timeout, expected = _targets(archs, worlds, ring_only)[target]
    pool_of = WarmPools()
    rows: list[dict] = []

    @settings(max_examples=trials, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @hseed(seed)
    @given(cases)
    def run(case) -> None:
        start = time.perf_counter()
        verdict = run_verdict(pool_of, case.world, runner, case, tolerance, timeout, expected)
        rows.append({"case": case, "verdict": verdict, "seconds": time.perf_counter() - start})
        if not quiet and verdict.kind == "failing":
            print(f"FAILING {case!r}\n  {verdict.detail[:500]}", flush=True)

    try:
        run()
    finally:
        pool_of.close()
    return rows


COLUMNS = [("mode", "mode", ""), ("world", "world", ""), ("sp", "sp", ""), ("ring", "ring", ""),
           ("layout", "layout", ""), ("tp", "tp", ""), ("trials", "trials", ""), ("exact", "exact", ""),
           ("refused", "refused", ""), ("failing", "failing", ""), ("worst", "worst exact error", ".1e")]  # fmt: skip


def summarize(rows: list[dict]) -> list[dict]:
    """Verdict counts and the worst error of an exact trial per (mode, world size, sequence-parallel size: the
    world for the attention core, its ring degree, the ring's layout, tensor-parallel size)."""
    counts: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    worst: dict[tuple, float | None] = {}
    for r in rows:
        c = r["case"]
        ring = getattr(c, "ring_size", 1)
        layout = getattr(c, "ring_kind", "zigzag") if ring > 1 else "-"  # the strategy: zigzag
        key = (
            c.mode,
            c.world,
            getattr(c, "sp", c.world),
            ring,
            layout,
            getattr(c, "tensor_parallel_size", 1),
        )
        counts[key][r["verdict"].kind] += 1
        worst.setdefault(key, None)
        if r["verdict"].kind == "exact":
            worst[key] = max(worst[key] or 0.0, r["verdict"].error or 0.0)
    return [
        {"mode": mode, "world": world, "sp": sp, "ring": ring, "layout": layout, "tp": tp,
         "trials": sum(cnt.values()), **{k: cnt[k] for k in ("exact", "refused", "failing")},
         "worst": worst[mode, world, sp, ring, layout, tp]}
        for (mode, world, sp, ring, layout, tp), cnt in sorted(counts.items())
    ]  # fmt: skip


def refusals_by_message(rows: list[dict]) -> dict[str, int]:
    """``"refused (expected: <class>): <message>" -> trials``, and ``"UNEXPECTED refusal: <message>"`` for the
    failing trials that refused a configuration the package promises to run (each message's first 120
    characters), most first."""
    keys = []
    for r in rows:
        v = r["verdict"]
        if v.refusal:
            what = f"refused (expected: {v.expected})" if v.kind == "refused" else "UNEXPECTED refusal"
            keys.append(f"{what}: {v.refusal.split(';')[0][:120]}")
    return dict(collections.Counter(keys).most_common())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=["attention", "strategy"], default="attention")
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--archs", default=None, help="strategy target: draw only these sweep architectures (a,b,...)"
    )
    p.add_argument(
        "--worlds", type=int, nargs="+", default=None, help="attention target: draw only these world sizes"
    )
    p.add_argument(
        "--ring-only", action="store_true", help="attention target: only Ulysses x ring (ring_size > 1)"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="JSON (default benchmarks/results/fuzz_<target>.json)"
    )
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    archs = args.archs.split(",") if args.archs else None
    rows = search(
        args.target, args.trials, args.seed, archs=archs, worlds=args.worlds, ring_only=args.ring_only
    )
    wall = time.perf_counter() - start
    table = summarize(rows)
    print(format_table(table, COLUMNS))
    worst = max((r["verdict"].error or 0.0 for r in rows if r["verdict"].kind == "exact"), default=0.0)
    print(f"{len(rows)} trials in {wall:.0f} s; worst relative error of an exact trial {worst:.2e}")
    if args.target == "attention":
        rings = sum(1 for r in rows if r["case"].ring_size > 1)
        print(f"Ulysses x ring (ring_size > 1, usp_attention) drawn in {rings} of {len(rows)} trials")
    from fuzz_common import expected_refusals

    expected = _targets(archs, args.worlds, args.ring_only)[args.target][4]
    promised = sum(1 for r in rows if not expected_refusals(r["case"], expected))
    print(
        f"{promised} of {len(rows)} trials drew a configuration the package promises to run (no documented refusal)"
    )
    refusals = refusals_by_message(rows)
    for why, n in refusals.items():
        print(f"  {why} x{n}")
    seen = {r["verdict"].expected for r in rows if r["verdict"].expected}
    for entry in expected:
        if entry.name in seen:
            print(f"  why '{entry.name}' is expected: {entry.reason}")
    dist, drawn = {}, {}
    if args.target == "strategy":
        from fuzz_strategy import distribution

        dist = distribution(r["case"] for r in rows)
        for name, counts in dist.items():
            print(f"drawn {name}: " + ", ".join(f"{value} x{n}" for value, n in counts.items()))
        drawn = {
            name: sum(1 for r in rows if getattr(r["case"], attr) not in (None, False))
            for name, attr in (("PositionalLoss", "positional_loss"), ("NeedleRetrieval", "needle"))
        }
        print("validation callbacks drawn: " + ", ".join(f"{k} in {v} trials" for k, v in drawn.items()))
    failing = [r for r in rows if r["verdict"].kind == "failing"]
    if failing:
        print("\nfailing configurations, ready to paste into REGRESSIONS (tests/test_fuzz.py):")
        for i, r in enumerate(failing):
            print(
                f'    "found_{args.seed}_{i}": {r["case"]!r},  # {r["verdict"].detail.splitlines()[0][:100]}'
            )
    out = args.out or RESULTS / f"fuzz_{args.target}.json"
    seconds = [r["seconds"] for r in rows]
    write_json(out, {
        "target": args.target, "trials": len(rows), "seed": args.seed, "worlds": args.worlds,
        "ring_only": args.ring_only, "wall_s": wall,
        "environment": environment(), "summary": table, "worst_exact_error": worst,
        "seconds_per_trial": {"mean": sum(seconds) / max(len(seconds), 1), "max": max(seconds, default=0.0)},
        "promised": promised, "refusals": refusals, "distribution": dist, "callbacks_drawn": drawn,
        "failing": [{"case": asdict(r["case"]), "verdict": asdict(r["verdict"])} for r in failing],
    })  # fmt: skip
    print(f"wrote {out}")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
