"""HFDatasetDataModule at two corpus sizes: host RSS must not grow with the corpus; loader tokens/s.

For each size (default 50 MB and 500 MB of text, a 10x ratio) a synthetic corpus is written as jsonl into a
temporary folder (documents of 1-64 KB of pseudo-words drawn from a fixed seeded vocabulary; a WordLevel
tokenizer over those words saved beside it), then, each in a fresh process (``common.launch``):

1. **tokenize**: ``prepare_data()`` — ``load_dataset("json")`` and the one-time ``Dataset.map`` into the
   datasets cache (time, tokens, cache size on disk);
2. **read**: a new datamodule, ``setup()`` (a cache hit: no tokenizer call), then ``--batches`` batches of
   ``--seq-len`` tokens from its (shuffled) train loader. RSS is read from ``/proc/self/status`` (live
   memory: after ``gc.collect()``, ``malloc_trim(0)`` and Arrow's pool ``release_unused()``) before
   ``setup()`` (the baseline: libraries imported, nothing loaded), after ``setup()`` and after the batches:
   the increase over the baseline, split into anonymous memory (``RssAnon``: what the process allocated)
   and file pages (``RssFile``: the memory-mapped Arrow pages read, page cache the kernel can drop). The
   loader's tokens/s is the batches' tokens over the time to iterate them.

Verdict (exit status 1 otherwise): the anonymous-memory increase after the batches at the largest size is
within ``--max-growth-mib`` of the smallest size's. The loader's rate is printed beside a training step's:
this CPU's measured Trainer step (``results/throughput_8k.json``, a tiny Llama) and an estimate for Llama-3-8B
on one H100 at 40 % MFU (``lightning_longctx.planner.flops``; an estimate, not a measurement). See ``docs/data.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
from common import MIB

HERE = Path(__file__).resolve().parent
MB = 1_000_000
VOCAB_WORDS = 4000
COLUMNS = [
    ("size_mb", "corpus MB", ""),
    ("documents", "documents", ""),
    ("tokens_m", "tokens M", ".1f"),
    ("tokenize_s", "tokenize s", ".1f"),
    ("cache_mb", "cache MB", ".0f"),
    ("setup_anon_mib", "setup +anon MiB", ".1f"),
    ("setup_file_mib", "setup +file MiB", ".1f"),
    ("iter_anon_mib", "batches +anon MiB", ".1f"),
    ("iter_file_mib", "batches +file MiB", ".1f"),
    ("iter_rss_mib", "batches +RSS MiB", ".1f"),
    ("loader_tokens_per_s", "loader tokens/s", ".3g"),
]


def _words() -> list[str]:
    import random

    rnd = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set()
    while len(words) < VOCAB_WORDS:
        words.add("".join(rnd.choices(letters, k=rnd.randint(2, 9))))
    return sorted(words)


def write_tokenizer(path: Path) -> str:
    """A WordLevel tokenizer over the corpus words (BOS, EOS, PAD, UNK + the words), saved to ``path``."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *_words()])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.save_pretrained(path)
    return str(path)


def write_corpus(path: Path, size_bytes: int, seed: int) -> int:
    """``size_bytes`` of jsonl (``{"text": ...}`` per line), documents of 1-64 KB; returns the documents."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = np.array(_words())
    written = docs = 0
    with path.open("w") as f:
        while written < size_bytes:
            n_words = int(np.exp(rng.uniform(np.log(170), np.log(11_000))))  # ~6 bytes a word: 1-64 KB
            line = json.dumps({"text": " ".join(words[rng.integers(0, len(words), n_words)])}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def _status_bytes() -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` of ``/proc/self/status`` in bytes, of live memory: after gc,
    ``malloc_trim(0)`` and Arrow's pool handing back what it keeps for reuse (``release_unused``)."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    common.live_rss_bytes()  # gc.collect() + malloc_trim(0)
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _datamodule(args: argparse.Namespace, root: str) -> Any:
    from lightning_longctx.data import HFDatasetDataModule

    return HFDatasetDataModule(
        "json",
        f"{root}/tok",
        args.seq_len,
        data_files=f"{root}/corpus.jsonl",
        cache_dir=f"{root}/cache",
        num_proc=args.num_proc,
        num_workers=args.num_workers,
    )


def _tokenize(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Fresh process: the one-time load + tokenization (``prepare_data``)."""
    t0 = time.perf_counter()
    _datamodule(args, root).prepare_data()
    seconds = time.perf_counter() - t0
    cache = sum(p.stat().st_size for p in Path(root, "cache").rglob("cache-*.arrow"))
    arrow = sum(p.stat().st_size for p in Path(root, "cache").rglob("*.arrow")) - cache
    return {"tokenize_s": seconds, "cache_bytes": cache, "arrow_copy_bytes": arrow}


def _read(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Fresh process: setup() from the cache, then ``args.batches`` batches; RSS at each point."""
    import torch

    import lightning_longctx.data.hf as hf_data

    def refuse(*a: Any) -> Any:
        raise RuntimeError("setup() tokenized again: the cache was not hit")

    hf_data._Tokenize.__call__ = refuse  # this process only reads: a cache miss fails the benchmark
    torch.manual_seed(0)
    dm = _datamodule(args, root)
    base = _status_bytes()
    dm.setup("fit")
    after_setup = _status_bytes()
    data = dm.train_dataset
    loader = dm.train_dataloader()
    tokens, t0 = 0, time.perf_counter()
    for i, batch in enumerate(loader):
        tokens += batch["input_ids"].numel()
        if i + 1 == args.batches:
            break
    seconds = time.perf_counter() - t0
    del batch
    after_iter = _status_bytes()
    return {
        "documents": data.num_documents,
        "tokens": data.num_tokens,
        "rows": len(data),
        "index_bytes": int(data.cum.nbytes),
        "base": base,
        "after_setup": after_setup,
        "after_batches": after_iter,
        "batches": min(args.batches, len(loader)),
        "loader_s": seconds,
        "loader_tokens_per_s": tokens / seconds,
    }


def training_reference(seq_len: int) -> dict[str, Any]:
    """A training step's tokens/s: this CPU's measured Trainer step (if its result file is there) and an
    estimate for Llama-3-8B on one H100 at 40 % MFU from the package's FLOP count."""
    from transformers import LlamaConfig

    from lightning_longctx.planner.flops import flops_per_token, get_peak_flops

    llama8b = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    ref: dict[str, Any] = {
        "llama3_8b_h100_40pct_mfu_tokens_per_s": 0.4
        * get_peak_flops("H100", "bf16")
        / flops_per_token(llama8b, seq_len)
    }
    measured = HERE / "results" / "throughput_8k.json"
    if measured.is_file():
        rows = json.loads(measured.read_text())["results"]
        best = max(rows, key=lambda r: r["tokens_per_sec"])
        ref["cpu_trainer_tokens_per_s"] = best["tokens_per_sec"]
        ref["cpu_trainer_source"] = f"results/throughput_8k.json ({best['mode']}, N={best['seq_len']})"
    return ref


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[50, 500], help="corpus sizes in MB of jsonl")
    p.add_argument("--seq-len", type=int, default=32768, help="tokens per row")
    p.add_argument("--batches", type=int, default=50, help="batches (of one row) read after setup()")
    p.add_argument("--num-proc", type=int, default=None, help="processes for the one-time tokenization")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers")
    p.add_argument("--max-growth-mib", type=float, default=16.0,
                   help="fail when the largest corpus adds more anonymous memory than the smallest by this")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="5 and 50 MB, 10 batches: ~1-2 min on 2 cores")
    p.add_argument(
        "--workdir", default=None, help="where the corpora go (default: a temporary folder, removed)"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="per process, seconds")
    p.add_argument("--out", default=str(HERE / "results" / "data.json"))
    args = p.parse_args()
    if args.quick:
        args.sizes_mb, args.batches = [5, 50], 10

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_data_"))
    rows, runs, failures = [], [], []
    try:
        for size in args.sizes_mb:
            root = work / f"{size}mb"
            root.mkdir(parents=True, exist_ok=True)
            write_tokenizer(root / "tok")
            t0 = time.perf_counter()
            write_corpus(root / "corpus.jsonl", size * MB, seed=size)
            gen_s = time.perf_counter() - t0
            tok = common.launch(_tokenize, 1, args, str(root), timeout_s=args.timeout).check()[0]
            read = common.launch(_read, 1, args, str(root), timeout_s=args.timeout).check()[0]
            base = read["base"]

            def grew(point: str, key: str, base: dict = base, read: dict = read) -> float:
                return (read[point][key] - base[key]) / MIB

            rows.append(
                {
                    "size_mb": size,
                    "documents": read["documents"],
                    "tokens_m": read["tokens"] / 1e6,
                    "tokenize_s": tok["tokenize_s"],
                    "cache_mb": tok["cache_bytes"] / MB,
                    "setup_anon_mib": grew("after_setup", "RssAnon"),
                    "setup_file_mib": grew("after_setup", "RssFile"),
                    "iter_anon_mib": grew("after_batches", "RssAnon"),
                    "iter_file_mib": grew("after_batches", "RssFile"),
                    "iter_rss_mib": grew("after_batches", "VmRSS"),
                    "loader_tokens_per_s": read["loader_tokens_per_s"],
                    "baseline_rss_mib": base["VmRSS"] / MIB,
                    "index_kib": read["index_bytes"] / 1024,
                }
            )
            runs.append({"size_mb": size, "generate_s": gen_s, "tokenize": tok, "read": read})
            print(f"{size} MB done: tokenize {tok['tokenize_s']:.0f} s", flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    ref = training_reference(args.seq_len)
    print(f"HFDatasetDataModule: json corpora, seq_len {args.seq_len}, {args.batches} shuffled batches of 1 row, "
          f"num_workers {args.num_workers}; RSS increase over the baseline (live: gc, malloc_trim, Arrow pool released)")  # fmt: skip
    print(common.format_table(rows, COLUMNS))
    growth = rows[-1]["iter_anon_mib"] - rows[0]["iter_anon_mib"]
    ratio = rows[-1]["size_mb"] / rows[0]["size_mb"]
    print(f"anonymous memory after the batches, largest vs smallest corpus ({ratio:.0f}x): {growth:+.1f} MiB "
          f"(limit {args.max_growth_mib}); the document index is {rows[-1]['index_kib']:.0f} KiB at the largest")  # fmt: skip
    rate = min(r["loader_tokens_per_s"] for r in rows)
    print(f"loader {rate:.3g} tokens/s per process vs a training step: "
          f"Llama-3-8B on one H100 at 40% MFU, N={args.seq_len}: ~{ref['llama3_8b_h100_40pct_mfu_tokens_per_s']:.3g} "
          "tokens/s (estimate)"
          + (f"; this CPU's Trainer step, {ref['cpu_trainer_source']}: {ref['cpu_trainer_tokens_per_s']:.3g} tokens/s"
             if "cpu_trainer_tokens_per_s" in ref else ""))  # fmt: skip
    if growth > args.max_growth_mib:
        failures.append(
            f"anonymous memory grows with the corpus: {growth:+.1f} MiB at {ratio:.0f}x the corpus"
        )
    for f in failures:
        print(f"FAIL: {f}")
    fields = {"summary": rows, "training_reference": ref, "failures": failures, "runs": runs}
    common.save_results("data", vars(args), fields, args.out)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
