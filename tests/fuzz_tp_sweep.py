"""Tensor parallelism over the architecture sweep: every dense model the sweep runs exactly, one Trainer step
at world 4 = sequence parallel 2 x tensor parallel 2 (FSDP2), against the single-process loop.

    python benchmarks/tp_sweep.py                  # both modes, the plan styles the package accepts
    python benchmarks/tp_sweep.py --all-styles     # every style of transformers' plans, to see which are exact
    python benchmarks/tp_sweep.py --archs llama,phi3 --modes fpdt

Each run is ``tests/fuzz_strategy.run_strategy`` (every parameter after one SGD step, relative error within
``fuzz_strategy.TOLERANCE``; packed documents and two micro-batches), judged exact / refused / failing as the
fuzz does (``tests/fuzz_common.py``). ``--all-styles`` lifts the package's check of the plan styles
(``tensor_parallel.TESTED_STYLES``) inside the ranks: how a style not accepted yet would behave. Prints a
table per model and writes the JSON (``--out``, default ``benchmarks/results/tp_sweep.json``).

(``benchmarks/tp_sweep.py`` runs this script, ``tests/fuzz_tp_sweep.py``, with the same arguments: the sweep
lives beside the test modules it runs, which import each other by name.)
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from lightning_longctx.testing import environment, format_table, write_json

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"

COLUMNS = [("arch", "arch", ""), ("styles", "plan styles", ""), ("ulysses", "ulysses", ""),
           ("fpdt", "fpdt", "")]  # fmt: skip


def run_tp_all_styles(case):
    """:func:`run_tp` with every plan style accepted."""
    return run_tp(case, all_styles=True)


def run_tp(case, all_styles: bool = False):
    """On every rank: :func:`fuzz_strategy.run_strategy`, with every plan style accepted if ``all_styles``."""
    import fuzz_strategy

    if all_styles:
        import transformers.distributed.tensor_parallel as hf_tp

        import lightning_longctx.parallel.tensor_parallel as tp

        tp.TESTED_STYLES = tuple(hf_tp.ALL_PARALLEL_STYLES)
    return fuzz_strategy.run_strategy(case)


def _plan_styles(arch) -> list[str]:
    import transformers

    cfg = getattr(transformers, arch.config_class)()
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return sorted(set((getattr(cfg, "base_model_tp_plan", None) or {}).values()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--archs", default=None, help="comma-separated sweep names (default: the sweep's exact dense ones)"
    )
    p.add_argument("--modes", default="ulysses,fpdt")
    p.add_argument(
        "--all-styles", action="store_true", help="accept every transformers plan style in the ranks"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import fuzz_tp_sweep  # by module name: the ranks unpickle its functions (not __main__'s)
    from arch_sweep import ARCHS, DOCS, arch_by_name
    from fuzz_common import run_verdict
    from fuzz_strategy import TIMEOUT_S, TOLERANCE, StratCase

    from lightning_longctx.testing import WarmPools

    runner = fuzz_tp_sweep.run_tp_all_styles if args.all_styles else fuzz_tp_sweep.run_tp

    exact = set(re.findall(r"^\| `([\w-]+)` \|.*\| exact \| exact \|$", DOCS.read_text(), flags=re.M))
    names = args.archs.split(",") if args.archs else [a.name for a in ARCHS if not a.moe and a.name in exact]
    modes = args.modes.split(",")
    pool_of = WarmPools()
    rows, start = [], time.perf_counter()
    try:
        for name in names:
            arch = arch_by_name(name)
            row = {"arch": name, "styles": ", ".join(_plan_styles(arch)) or "(no plan)"}
            for mode in ("ulysses", "fpdt"):
                if mode not in modes:
                    row[mode] = "-"
                    continue
                case = StratCase(
                    arch=name, world=4, sp=2, seq=24, accumulate=2, data_parallel="fsdp", tensor_parallel_size=2,
                    fpdt_chunk_size=3 if mode == "fpdt" else None, packed=True, seed=1,
                )  # fmt: skip
                verdict = run_verdict(pool_of, 4, runner, case, TOLERANCE, TIMEOUT_S)
                row[mode] = verdict.kind if verdict.kind != "exact" else f"exact {verdict.error:.1e}"
                row[f"{mode}_detail"] = verdict.detail[-1500:] if verdict.detail else ""
            rows.append(row)
            print({k: v for k, v in row.items() if not k.endswith("_detail")}, flush=True)
    finally:
        pool_of.close()
    wall = time.perf_counter() - start
    print(format_table(rows, COLUMNS))
    counts = {m: {k: sum(1 for r in rows if str(r[m]).startswith(k)) for k in ("exact", "refused", "failing")}
              for m in modes}  # fmt: skip
    print(f"{len(rows)} models in {wall:.0f} s: {counts}")
    for r in rows:
        for m in modes:
            if not str(r[m]).startswith("exact"):
                print(f"  {r['arch']} {m}: {r[m]}: {r[f'{m}_detail'][:200]}")
    out = args.out or RESULTS / "tp_sweep.json"
    write_json(out, {"all_styles": args.all_styles, "wall_s": wall, "environment": environment(),
                     "counts": counts, "rows": rows})  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
