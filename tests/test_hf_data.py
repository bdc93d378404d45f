"""HFDatasetDataModule: Hugging Face ``datasets`` corpora tokenized once, packed exactly as ``pack_documents``,
read memory-mapped; chat masking, pre-tokenized data, the cache, resuming, errors and one real Trainer run."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lightning_longctx.data.hf as hf_data
from lightning_longctx.data import HFDatasetDataModule, TextFilesDataModule, pack_documents

datasets = pytest.importorskip("datasets")

WORDS = "hello world the cat sat on mat a b c".split()
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
ROLES = ["system", "user", "assistant"]
SEQ = 16
#: marks each assistant turn ({% generation %}), so transformers returns the assistant mask itself
GEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }} <|im_end|>{% endgeneration %}{% else %}{{ m['content'] }} <|im_end|>{% endif %} "
    "{% endfor %}"
)
#: ChatML-like without markers: the assistant turns are found by rendering prefixes
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
#: rewrites earlier turns (renders only the last message): prefixes cannot locate the turns
REWRITING_TEMPLATE = "{{ messages[-1]['content'] }}"


def _save_tokenizer(path, template=None) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIALS, *WORDS, *ROLES])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[4:],
    )
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        name: _save_tokenizer(root / name, template)
        for name, template in [
            ("plain", None),
            ("gen", GEN_TEMPLATE),
            ("prefix", PLAIN_TEMPLATE),
            ("rewriting", REWRITING_TEMPLATE),
        ]
    }


def _texts(n: int = 12, seed: int = 0) -> list[str]:
    """Short documents, one empty (dropped, as TextFilesDataModule drops it) and one spanning three rows."""
    rnd = random.Random(seed)
    docs = [" ".join(rnd.choices(WORDS, k=rnd.randint(1, 12))) for _ in range(n)]
    docs[3] = ""
    docs[5] = " ".join(WORDS * 4)
    return docs


def _write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _rows(ds) -> dict[str, torch.Tensor]:
    return {
        k: torch.stack([ds[i][k] for i in range(len(ds))]) for k in ("input_ids", "labels", "position_ids")
    }


def _assert_rows_equal(ds, expected: dict[str, torch.Tensor]) -> None:
    got = _rows(ds)
    for k, want in expected.items():
        assert got[k].dtype == torch.long and torch.equal(got[k], want), k


def _expected(texts, tokenizer: str, seq_len: int = SEQ, **kw) -> dict[str, torch.Tensor]:
    """pack_documents of the texts tokenized as TextFilesDataModule tokenizes them (the spec)."""
    reference = TextFilesDataModule(["unused"], seq_len=seq_len, tokenizer=tokenizer)
    docs = [reference._tokenize(t) for t in texts if t]
    return pack_documents(docs, seq_len=seq_len, pad_id=reference.tokenizer.pad_token_id, **kw)


def _source(kind: str, tmp_path, texts) -> tuple[str, dict]:
    """The same documents as a json file, a parquet file, a Dataset / DatasetDict save_to_disk folder."""
    if kind == "json":
        return "json", {
            "data_files": _write_jsonl(tmp_path / "c.jsonl", [{"text": t, "id": 1} for t in texts])
        }
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), tmp_path / "c.parquet")
        return "parquet", {"data_files": str(tmp_path / "c.parquet")}
    table = datasets.Dataset.from_dict({"text": texts})
    if kind == "disk":
        table.save_to_disk(tmp_path / "saved")
    else:
        datasets.DatasetDict({"train": table, "validation": table.select(range(4))}).save_to_disk(
            tmp_path / "saved"
        )
    return str(tmp_path / "saved"), {}


@pytest.mark.parametrize("kind", ["json", "parquet", "disk", "disk_dict"])
def test_documents_packing_equals_pack_documents(kind, tmp_path, toks):
    texts = _texts()
    dataset, kw = _source(kind, tmp_path, texts)
    dm = HFDatasetDataModule(
        dataset, toks["plain"], SEQ, cache_dir=str(tmp_path / "cache"), batch_size=2, **kw
    )
    dm.prepare_data()
    dm.setup("fit")
    expected = _expected(texts, toks["plain"])
    _assert_rows_equal(dm.train_dataset, expected)
    assert len(dm.train_dataset) == len(expected["input_ids"]) >= 5
    assert dm.train_dataset.num_documents == len(texts) - 1  # the empty document is dropped
    assert dm.vocab_size == len(SPECIALS) + len(WORDS) + len(ROLES)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert all(v.shape == (2, SEQ) and v.dtype == torch.long for v in batch.values())
    assert dm.val_dataloader() == []
    assert int(expected["position_ids"].max()) < SEQ  # documents split at the row edge (test_data.py)
    assert dm.max_positions() == int(expected["position_ids"].max()) + 1  # from the lengths, no row read
    carried = HFDatasetDataModule(
        dataset, toks["plain"], SEQ, cache_dir=str(tmp_path / "cache"), continue_documents=True, **kw
    )
    carried.setup("fit")
    want = _expected(texts, toks["plain"], continue_documents=True)
    _assert_rows_equal(carried.train_dataset, want)
    assert carried.max_positions() == int(want["position_ids"].max()) + 1 > SEQ  # _texts' 3-row document
    if kind == "disk_dict":
        val = HFDatasetDataModule(dataset, toks["plain"], SEQ, val_split="validation")
        val.setup("fit")
        _assert_rows_equal(val.val_dataset, _expected(texts[:4], toks["plain"]))


def test_val_fraction_holds_out_what_text_files_does(tmp_path, toks):
    texts = _texts(20, seed=1)
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    ours = HFDatasetDataModule(
        "json", toks["plain"], SEQ, data_files=path, val_fraction=0.25, seed=3, cache_dir=str(tmp_path / "c")
    )
    ours.setup("fit")
    theirs = TextFilesDataModule([path], seq_len=SEQ, tokenizer=toks["plain"], val_fraction=0.25, seed=3)
    theirs.setup("fit")
    _assert_rows_equal(ours.train_dataset, theirs.train_dataset.packed)
    _assert_rows_equal(ours.val_dataset, theirs.val_dataset.packed)
    assert ours.val_dataset.rows is not None and len(ours.val_dataset.rows) == 5


def test_packing_none_and_min_doc_tokens(tmp_path, toks):
    texts = _texts()
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    reference = TextFilesDataModule(["unused"], seq_len=SEQ, tokenizer=toks["plain"])
    docs = [reference._tokenize(t) for t in texts if t]
    kw = dict(data_files=path, cache_dir=str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="1 of 11 training documents are longer than seq_len=16"):
        dm = HFDatasetDataModule("json", toks["plain"], SEQ, packing="none", **kw)
        dm.setup("fit")
    # one document per row: pack_documents of that document alone, cut to seq_len
    rows = [pack_documents([d[:SEQ]], seq_len=SEQ, pad_id=0) for d in docs]
    _assert_rows_equal(dm.train_dataset, {k: torch.cat([r[k] for r in rows]) for k in rows[0]})
    assert dm.train_dataset.max_positions() == SEQ  # every row padded or cut to the row, positions on

    long_docs = [d for d in docs if len(d) >= 8]
    assert 1 < len(long_docs) < len(docs)
    dm = HFDatasetDataModule("json", toks["plain"], SEQ, min_doc_tokens=8, **kw)
    dm.setup("fit")
    _assert_rows_equal(dm.train_dataset, pack_documents(long_docs, seq_len=SEQ, pad_id=0))


def test_pretokenized_input_ids(tmp_path):
    docs = [[5, 6, 7], [8, 9, 10, 11, 12], [], [13] * 20, [3, 4]]
    path = _write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": d, "meta": "x"} for d in docs])
    dm = HFDatasetDataModule(
        "json", None, SEQ, data_files=path, vocab_size=20, pad_token_id=1, cache_dir=str(tmp_path / "c")
    )
    dm.setup("fit")
    assert dm.vocab_size == 20
    _assert_rows_equal(dm.train_dataset, pack_documents([d for d in docs if d], seq_len=SEQ, pad_id=1))

    # a `labels` column (-100 where no loss, else the token) masks the loss on top of the packing rules
    labels = [[-100, 6, 7], [-100, -100, 10, 11, 12], [13] * 20]
    kept = [docs[0], docs[1], docs[3]]
    path = _write_jsonl(
        tmp_path / "sft.jsonl", [{"input_ids": d, "labels": lab} for d, lab in zip(kept, labels)]
    )
    dm = HFDatasetDataModule("json", None, SEQ, data_files=path, vocab_size=20, cache_dir=str(tmp_path / "c"))
    dm.setup("fit")
    want = pack_documents(kept, seq_len=SEQ, pad_id=0)
    mask = torch.tensor([t != -100 for lab in labels for t in lab])
    want["labels"].view(-1)[: len(mask)][~mask] = -100
    _assert_rows_equal(dm.train_dataset, want)


def test_chat_loss_on_assistant_turns_only(tmp_path, toks):
    chats = [
        [
            {"role": "system", "content": "a b"},
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "the cat"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "sat on mat"},
        ],
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}],
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in chats])
    ids = {t: i for i, t in enumerate([*SPECIALS, *WORDS, *ROLES])}
    start, end = ids["<|im_start|>"], ids["<|im_end|>"]
    tokens, loss = [], []
    for chat in chats:
        for m in chat:
            turn = [start, ids[m["role"]], *(ids[w] for w in m["content"].split()), end]
            tokens += turn
            # the assistant's content and its end-of-turn token are trained on; roles, markers, prompts not
            loss += [False, False] + [m["role"] == "assistant"] * (len(turn) - 2)
    want = pack_documents([tokens[:25], tokens[25:]], seq_len=40, pad_id=0)
    trained = torch.zeros(40, dtype=torch.bool)
    trained[: len(loss)] = torch.tensor(loss)
    want["labels"][0][~trained] = -100
    assert want["labels"][0].ne(-100).sum() == 3 + 4 + 2
    for template in ("gen", "prefix"):
        dm = HFDatasetDataModule(
            "json", toks[template], 40, data_files=path, cache_dir=str(tmp_path / template)
        )
        dm.setup("fit")
        _assert_rows_equal(dm.train_dataset, want)

    dm = HFDatasetDataModule("json", toks["rewriting"], 40, data_files=path, cache_dir=str(tmp_path / "r"))
    with pytest.raises(ValueError, match="renders a conversation's beginning differently"):
        dm.setup("fit")
    dm = HFDatasetDataModule("json", toks["plain"], 40, data_files=path, cache_dir=str(tmp_path / "p"))
    with pytest.raises(ValueError, match=r"holds chat messages but tokenizer=.* has no chat template"):
        dm.setup("fit")


def test_tokenized_once_then_read_from_the_cache(tmp_path, toks, monkeypatch):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in _texts()])
    kw = dict(data_files=path, cache_dir=str(tmp_path / "cache"))
    HFDatasetDataModule("json", toks["plain"], SEQ, **kw).prepare_data()  # the first process of the node
    files = sorted((tmp_path / "cache").rglob("cache-*.arrow"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns

    def tokenizer_called(*args):
        raise AssertionError("setup() tokenized again instead of reading the cache")

    # the fingerprint hashes the function's settings, not its code: patching __call__ keeps it
    monkeypatch.setattr(hf_data._Tokenize, "__call__", tokenizer_called)
    dm = HFDatasetDataModule("json", toks["plain"], SEQ, **kw)  # another process: a new datamodule
    dm.setup("fit")
    assert len(dm.train_dataset) > 0
    assert (
        sorted((tmp_path / "cache").rglob("cache-*.arrow")) == files and files[0].stat().st_mtime_ns == stamp
    )
    # a setting that changes the tokens changes the fingerprint: tokenized again, not a stale cache
    with pytest.raises(AssertionError, match="tokenized again"):
        HFDatasetDataModule("json", toks["plain"], SEQ, add_bos=False, **kw).setup("fit")


def test_resumes_mid_epoch(tmp_path, toks):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in _texts(30)])
    kw = dict(data_files=path, cache_dir=str(tmp_path / "cache"), batch_size=2)
    torch.manual_seed(0)
    full = list(HFDatasetDataModule("json", toks["plain"], SEQ, **kw).train_dataloader())
    assert len(full) >= 6
    loader = HFDatasetDataModule("json", toks["plain"], SEQ, **kw).train_dataloader()
    torch.manual_seed(0)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    assert state == {"batches_yielded": 3}
    resumed = HFDatasetDataModule("json", toks["plain"], SEQ, **kw).train_dataloader()
    resumed.load_state_dict(state)
    torch.manual_seed(0)  # the sampler's seed: Lightning's DistributedSampler is seeded per epoch alike
    rest = list(resumed)
    assert len(rest) == len(full) - 3
    for a, b in zip(rest, full[3:]):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_importing_data_does_not_import_datasets(monkeypatch):
    """`datasets` is optional: lightning_longctx.data imports without it; the datamodule says how to install."""
    spec = importlib.util.spec_from_file_location(
        "_data_without_datasets", Path(hf_data.__file__).with_name("__init__.py")
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails from here on
    spec.loader.exec_module(module)
    assert module.HFDatasetDataModule is HFDatasetDataModule
    assert "HFDatasetDataModule" in module.__all__
    with pytest.raises(ImportError, match=r"lightning-longctx\[data\]"):
        HFDatasetDataModule("json", None, 8, data_files="x.jsonl", vocab_size=8)


def _bad(tmp_path, toks, case: str):
    """The datamodule of one bad input, and whether the error comes from setup() (else the constructor)."""
    cache = str(tmp_path / "cache")
    text = _write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}])
    if case == "unknown_column":
        body = _write_jsonl(tmp_path / "b.jsonl", [{"body": "hello", "id": 1}])
        return lambda: HFDatasetDataModule("json", toks["plain"], 8, data_files=body, cache_dir=cache), True
    if case == "empty_corpus":
        empty = _write_jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": ""}])
        return lambda: HFDatasetDataModule("json", toks["plain"], 8, data_files=empty, cache_dir=cache), True
    if case == "all_too_short":
        return lambda: HFDatasetDataModule(
            "json", toks["plain"], 8, data_files=text, cache_dir=cache, min_doc_tokens=50
        ), True
    if case == "text_without_tokenizer":
        return lambda: HFDatasetDataModule(
            "json", None, 8, data_files=text, cache_dir=cache, vocab_size=9
        ), True
    if case == "ids_out_of_vocab":
        ids = _write_jsonl(tmp_path / "i.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [3, 9]}])
        return lambda: HFDatasetDataModule(
            "json", None, 8, data_files=ids, cache_dir=cache, vocab_size=9
        ), True
    if case == "missing_split":
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(
            tmp_path / "d"
        )
        return lambda: HFDatasetDataModule(
            str(tmp_path / "d"), toks["plain"], 8, val_split="validation"
        ), True
    if case == "hub_name_not_cached":
        return lambda: HFDatasetDataModule("someone/not-cached-here", toks["plain"], 8, cache_dir=cache), True
    constructor = {
        "missing_data_files": dict(dataset="json", tokenizer=toks["plain"], seq_len=8),
        "seq_len": dict(dataset="json", tokenizer=toks["plain"], seq_len=0, data_files=text),
        "packing": dict(dataset="json", tokenizer=toks["plain"], seq_len=8, data_files=text, packing="bins"),
        "no_vocab": dict(dataset="json", tokenizer=None, seq_len=8, data_files=text),
        "two_vals": dict(
            dataset="json",
            tokenizer=toks["plain"],
            seq_len=8,
            data_files=text,
            val_split="v",
            val_fraction=0.1,
        ),
    }[case]
    return lambda: HFDatasetDataModule(**constructor), False


BAD = {
    "unknown_column": (ValueError, r"no column 'text' \(text_column\).*its columns are \['body', 'id'\]"),
    "empty_corpus": (ValueError, "no documents in split 'train'.*every document is empty"),
    "all_too_short": (ValueError, "shorter than min_doc_tokens=50"),
    "text_without_tokenizer": (ValueError, "needs a tokenizer"),
    "ids_out_of_vocab": (ValueError, r"row 1: input_ids hold id 9 outside \[0, 9\)"),
    "missing_split": (ValueError, r"split 'validation' is not in the saved DatasetDict.*\['train'\]"),
    "hub_name_not_cached": (FileNotFoundError, "not-cached-here.*this package never downloads"),
    "missing_data_files": (ValueError, "dataset='json' reads local files: pass data_files"),
    "seq_len": (ValueError, "seq_len=0 must be >= 1"),
    "packing": (ValueError, r"packing='bins' is not one of \('documents', 'none'\)"),
    "no_vocab": (ValueError, "tokenizer=None needs vocab_size"),
    "two_vals": (ValueError, "both ask for validation data; pass one"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_clearly(case, tmp_path, toks):
    error, match = BAD[case]
    make, in_setup = _bad(tmp_path, toks, case)
    if not in_setup:
        with pytest.raises(error, match=match):
            make()
        return
    dm = make()
    with pytest.raises(error, match=match):
        dm.setup("fit")


# ------------------------------------------------------------------------- a real Trainer under the strategy

LR = 0.5  # HFModule's SGD


def _fit_from_datamodule(
    root: str, sp: int, steps: int, continue_documents: bool = False
) -> tuple[dict, list[float], int]:
    """On every pool rank: fit a tiny Llama (RoPE covering exactly the 24-token row) from the datamodule under
    UlyssesFPDTStrategy; count the rank's tokenizer calls (prepare_data tokenizes on the node's first process
    only; setup reads the cache). ``steps`` None: one epoch."""
    import lightning as L
    import torch.distributed as dist

    from helpers.hf_models import HFModule, tiny_model
    from helpers.lightning import lightning_env
    from lightning_longctx import UlyssesFPDTStrategy

    lightning_env()
    calls = []
    original = hf_data._Tokenize.__call__

    def counted(self, *args):
        calls.append(1)
        return original(self, *args)

    hf_data._Tokenize.__call__ = counted
    try:
        dm = HFDatasetDataModule(
            "json", f"{root}/tok", 24, data_files=f"{root}/c.jsonl", cache_dir=f"{root}/cache",
            continue_documents=continue_documents,
        )  # fmt: skip
        model = tiny_model("llama", max_position_embeddings=24)
        module = HFModule(model, lr=LR)  # no dataset: the datamodule's loader is used
        trainer = L.Trainer(
            strategy=UlyssesFPDTStrategy(sequence_parallel_size=sp),
            accelerator="cpu",
            devices=dist.get_world_size(),
            max_steps=-1 if steps is None else steps,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, datamodule=dm)
    finally:
        hf_data._Tokenize.__call__ = original
    state = {k.removeprefix("model."): v for k, v in trainer.strategy.full_state_dict().items()}
    return state, module.losses, len(calls)


def _row_loss(model, row: dict[str, torch.Tensor]) -> torch.Tensor:
    """The row's mean token loss with each packed document (piece) run alone at its own positions."""
    ids, labels, pos = row["input_ids"], row["labels"], row["position_ids"]
    starts = [0, *pos[1:].eq(0).nonzero().flatten().add(1).tolist()]
    total, count = torch.zeros(()), 0
    for a, b in zip(starts, [*starts[1:], len(ids)]):
        targets = torch.cat([labels[a + 1 : b], labels.new_full((1,), -100)])
        logits = model(input_ids=ids[None, a:b], position_ids=pos[None, a:b]).logits[0].float()
        total = total + F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        count += int(targets.ne(-100).sum())
    return total / count


def _refusal_from_datamodule(root: str) -> str:
    """On every pool rank: the refusal of the same fit with positions carried across rows (raised in the
    strategy's setup, before any step)."""
    try:
        _fit_from_datamodule(root, 2, None, continue_documents=True)
    except ValueError as err:
        return str(err)
    return "not refused"


def _long_texts() -> list[str]:
    """Documents of 0.5x to 5x the 24-token row (a word is a token; BOS and EOS added)."""
    rnd = random.Random(4)
    return [" ".join(rnd.choices(WORDS, k=k)) for k in (10, 118, 30, 70, 22, 45, 100, 14)]


@pytest.mark.slow
def test_trainer_at_sp2_equals_one_process(dist_pool, tmp_path, toks):
    """A corpus whose documents run 0.5x to 5x the row, a model whose RoPE covers exactly the row: one full
    epoch at sp 2, no refusal, every step's loss and every parameter equal to one process. Positions carried on
    across rows (``continue_documents=True``) are refused before the first step that holds them."""
    from torch.utils.data import DistributedSampler

    from helpers.hf_models import tiny_model

    shutil.copytree(toks["plain"], tmp_path / "tok")
    _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in _long_texts()])
    results = dist_pool(2).run(_fit_from_datamodule, str(tmp_path), 2, None)
    assert [calls > 0 for _, _, calls in results] == [True, False], "only the node's first process tokenizes"

    dm = HFDatasetDataModule(
        "json",
        str(tmp_path / "tok"),
        24,
        data_files=str(tmp_path / "c.jsonl"),
        cache_dir=str(tmp_path / "cache"),
    )
    dm.setup("fit")
    data = dm.train_dataset
    steps = len(data)
    assert any(data[i]["position_ids"][1:].eq(0).any() for i in range(len(data))), "rows must pack documents"
    assert sum(data[i]["position_ids"][0] == 0 and data[i]["labels"][0] == -100 for i in range(steps)) >= 8
    assert all(len(losses) == steps for _, losses, _ in results), "one full epoch"
    order = list(
        DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    )  # Lightning's, dp = 1
    model = tiny_model("llama", max_position_embeddings=24)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = _row_loss(model, data[order[step]])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for state, rank_losses, _ in results:
        assert max(abs(a - b) for a, b in zip(rank_losses, losses)) < 1e-5
        for name, want in model.state_dict().items():
            assert (want - init[name]).abs().max() > 0, f"{name} never moved: the test would prove nothing"
            err = (state[name] - want).abs().max() / want.abs().max()
            assert err < 1e-5, f"{name}: relative error {err:.2e}"
    # positions carried on across rows: refused at setup (the data module knows its rows), on every rank
    refusals = dist_pool(2).run(_refusal_from_datamodule, str(tmp_path))
    for message in refusals:
        assert (
            "the datamodule's rows hold a sequence of 120 positions, but the model's RoPE covers 24"
            in message
        )
