from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from lightning_longctx.data import ByteTokenizer, TextFilesDataModule, pack_documents
from lightning_longctx.data.packing import PackedDataset
from lightning_longctx.recipes import RecallAccuracy, RecallDataModule, RecallDataset, recall_accuracy

# ------------------------------------------------------------------------------- recall task


def _in(range_: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    return (x >= range_[0]) & (x < range_[1])


def test_recall_deterministic_per_seed_split_index():
    a = RecallDataModule(seq_len=256, seed=3).train_dataset
    b = RecallDataModule(seq_len=256, seed=3).train_dataset
    for i in (0, 1, 17):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"])
        assert torch.equal(a[i]["labels"], b[i]["labels"])
    # out-of-order access gives the same sample: pure function of the index
    assert torch.equal(a[5]["input_ids"], RecallDataModule(seq_len=256, seed=3).train_dataset[5]["input_ids"])
    assert not torch.equal(a[0]["input_ids"], a[1]["input_ids"])
    other_seed = RecallDataModule(seq_len=256, seed=4).train_dataset
    assert not torch.equal(a[0]["input_ids"], other_seed[0]["input_ids"])
    val = RecallDataModule(seq_len=256, seed=3).val_dataset
    assert not torch.equal(a[0]["input_ids"], val[0]["input_ids"])


def test_recall_layout_and_labels():
    ds = RecallDataset(num_samples=4, seq_len=512, vocab_size=256, num_pairs=8, num_queries=2, seed=0)
    s = ds[2]
    ids, labels = s["input_ids"], s["labels"]
    assert ids.shape == labels.shape == (512,)
    assert ids.dtype == labels.dtype == torch.long
    assert ids.min() >= 0 and ids.max() < 256
    assert ids.ne(RecallDataset.PAD).all()

    hay = 512 - ds.query_len
    key_pos = torch.nonzero(_in(ds.key_range, ids[:hay])).flatten()
    assert len(key_pos) == 8 and len(set(ids[key_pos].tolist())) == 8  # distinct keys
    assert _in(ds.value_range, ids[key_pos + 1]).all()  # each key is followed by its value
    assert _in(ds.filler_range, ids[:hay]).sum() == hay - 16
    pairs = dict(zip(ids[key_pos].tolist(), ids[key_pos + 1].tolist()))

    assert ids[hay] == RecallDataset.SEP
    asked = []
    for q in range(2):
        at = hay + 1 + 3 * q
        assert ids[at] == RecallDataset.QUERY
        key, value = int(ids[at + 1]), int(ids[at + 2])
        assert pairs[key] == value
        assert labels[at + 2] == value
        asked.append(key)
    assert len(set(asked)) == 2
    answer_pos = [hay + 3, hay + 6]
    assert labels.ne(-100).nonzero().flatten().tolist() == answer_pos
    assert torch.equal(labels[answer_pos], ids[answer_pos])


def test_recall_keys_spread_over_every_quarter():
    ds = RecallDataModule(seq_len=1024, num_pairs=8).train_dataset
    for i in range(10):
        ids = ds[i]["input_ids"][: 1024 - ds.query_len]
        key_pos = torch.nonzero(_in(ds.key_range, ids)).flatten()
        quarters = set((key_pos * 4 // 1024).tolist())
        assert quarters == {0, 1, 2, 3}, (i, key_pos.tolist())


def test_recall_datamodule_loaders_and_chance():
    dm = RecallDataModule(seq_len=64, batch_size=4, train_samples=8, val_samples=4)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 64)
    assert batch["labels"].shape == (4, 64)
    assert dm.train_dataloader().sampler.__class__.__name__ == "RandomSampler"
    assert dm.val_dataloader().sampler.__class__.__name__ == "SequentialSampler"
    assert dm.num_value_tokens == 63  # (256 - 3) // 2 - (256 - 3) // 4
    assert dm.chance_accuracy == pytest.approx(1 / 63)
    assert dm.hparams.seq_len == 64


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(seq_len=10, num_pairs=8), "seq_len=10 is too short"),
        (dict(vocab_size=20, num_pairs=8), "vocab_size=20"),
        (dict(num_pairs=2, num_queries=3), "num_queries=3 > num_pairs=2"),
    ],
)
def test_recall_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RecallDataModule(**kwargs)


# ---------------------------------------------------------------------------- recall accuracy


def _one_hot_logits(targets: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(targets.clamp(min=0), vocab).float()


def test_recall_accuracy_unshifted_and_shifted():
    ds = RecallDataset(num_samples=3, seq_len=64, num_pairs=4, num_queries=2)
    batch = torch.utils.data.default_collate([ds[i] for i in range(3)])
    labels = batch["labels"]
    # perfect model: logits at t put all mass on labels[t + 1]
    shifted_labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    logits = _one_hot_logits(shifted_labels, 256)

    metric = RecallAccuracy()
    metric.update(logits, labels)
    assert metric.compute() == 1.0
    assert [int(x) for x in recall_accuracy(logits, labels)] == [6, 6]

    shifted = RecallAccuracy()
    shifted.update(logits, shifted_labels, shifted=True)
    assert shifted.compute() == 1.0

    # the same logits scored without the shift are off by one position: all wrong
    wrong = RecallAccuracy()
    wrong.update(logits, labels, shifted=True)
    assert wrong.compute() == 0.0

    # one of six answers wrong: the last answer (labels[0, -1]) is predicted at position -2
    wrong_value = ds.value_range[0] + int(labels[0, -1] == ds.value_range[0])
    logits[0, -2] = _one_hot_logits(torch.tensor(wrong_value), 256)
    metric = RecallAccuracy()
    metric.update(logits, labels)
    assert metric.compute() == pytest.approx(5 / 6)


def test_recall_accuracy_sums_over_shards_and_empty_is_zero():
    # two "ranks" each holding half of a pre-shifted sequence sum to the whole
    labels = torch.full((1, 8), -100)
    labels[0, 2], labels[0, 6] = 5, 7
    logits = _one_hot_logits(torch.tensor([[0, 0, 5, 0, 0, 0, 1, 0]]), 10)
    metric = RecallAccuracy()
    metric.update(logits[:, :4], labels[:, :4], shifted=True)
    metric.update(logits[:, 4:], labels[:, 4:], shifted=True)
    assert (int(metric.correct), int(metric.total)) == (1, 2)
    assert metric.compute() == 0.5
    empty = RecallAccuracy()
    empty.update(logits, torch.full((1, 8), -100), shifted=True)
    assert empty.compute() == 0.0
    with pytest.raises(ValueError, match="disagree"):
        recall_accuracy(logits, labels[:, :4], shifted=True)


def test_recall_fits_under_lightning():
    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(256, 8)
            self.head = torch.nn.Linear(8, 256)
            self.acc = RecallAccuracy()

        def training_step(self, batch, _):
            logits = self.head(self.emb(batch["input_ids"]))
            return torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100
            )

        def validation_step(self, batch, _):
            self.acc.update(self.head(self.emb(batch["input_ids"])), batch["labels"])
            self.log("acc", self.acc)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = RecallDataModule(seq_len=64, batch_size=2, train_samples=4, val_samples=2)
    trainer = L.Trainer(
        fast_dev_run=True,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), dm)
    assert 0.0 <= float(trainer.callback_metrics["acc"]) <= 1.0


# ------------------------------------------------------------------------------ text files


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "héllo, wörld — 你好 🚀\n"
    ids = tok.encode(text)
    assert min(ids) >= 3 and max(ids) < tok.vocab_size == len(tok) == 259
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id, tok.pad_token_id]) == text


def test_pack_documents_rules():
    docs = [[10, 11, 12], [20, 21], [30, 31, 32, 33, 34]]  # 10 tokens
    out = pack_documents(docs, seq_len=4, pad_id=0)
    assert out["input_ids"].tolist() == [[10, 11, 12, 20], [21, 30, 31, 32], [33, 34, 0, 0]]
    # a document split at a row edge starts the next row over: [21] and [33, 34] are documents of their own
    assert out["position_ids"].tolist() == [[0, 1, 2, 0], [0, 0, 1, 2], [0, 1, 2, 3]]
    assert out["labels"].tolist() == [[-100, 11, 12, -100], [-100, -100, 31, 32], [-100, 34, -100, -100]]
    # the explicit other behaviour: positions carried on into the next row
    carried = pack_documents(docs, seq_len=4, pad_id=0, continue_documents=True)
    assert carried["input_ids"].tolist() == out["input_ids"].tolist()
    assert carried["position_ids"].tolist() == [[0, 1, 2, 0], [1, 0, 1, 2], [3, 4, 5, 6]]
    assert carried["labels"].tolist() == [[-100, 11, 12, -100], [21, -100, 31, 32], [33, 34, -100, -100]]
    with pytest.raises(ValueError, match="no tokens"):
        pack_documents([], seq_len=4, pad_id=0)


def test_no_position_reaches_the_row_length():
    """Documents of 0.5x to 5x the row: every position below seq_len, and each row holds whole documents or
    pieces of one, each counted from 0 (a row's tokens are the documents' tokens, in order)."""
    g = torch.Generator().manual_seed(0)
    seq_len = 16
    docs = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (8, 80, 24, 40, 13, 71, 9)]
    out = pack_documents(docs, seq_len=seq_len, pad_id=0)
    flat = [t for d in docs for t in d]
    assert out["input_ids"].flatten()[: len(flat)].tolist() == flat
    assert int(out["position_ids"].max()) < seq_len
    carried = pack_documents(docs, seq_len=seq_len, pad_id=0, continue_documents=True)
    assert int(carried["position_ids"].max()) == 79  # the 80-token document, carried over 5 rows
    assert PackedDataset(out).max_positions() == seq_len and PackedDataset(carried).max_positions() == 80
    for row, ref in zip(out["position_ids"], carried["position_ids"]):
        first = int(ref[0])  # where the row's first piece stood in its document
        pieces = ref.clone()
        pieces[: int(ref.eq(0).int().argmax()) if ref[1:].eq(0).any() else len(ref)] -= first
        assert row.tolist() == pieces.tolist()


def _write_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("first doc")
    sub = tmp_path / "sub"
    sub.mkdir()
    with (sub / "b.jsonl").open("w") as f:
        for text in ("second", "", "third one"):
            f.write(json.dumps({"text": text, "id": 1}) + "\n")
        f.write("\n")
    (tmp_path / "ignored.csv").write_text("x,y")
    return ["first doc", "second", "third one"]


def test_text_files_packing(tmp_path):
    texts = _write_corpus(tmp_path)
    dm = TextFilesDataModule([str(tmp_path)], seq_len=8, batch_size=2)
    dm.setup("fit")
    tok = ByteTokenizer()
    expected = [t for text in texts for t in [tok.bos_token_id, *tok.encode(text), tok.eos_token_id]]
    ds = dm.train_dataset
    ids = torch.cat([ds[i]["input_ids"] for i in range(len(ds))])
    pos = torch.cat([ds[i]["position_ids"] for i in range(len(ds))])
    labels = torch.cat([ds[i]["labels"] for i in range(len(ds))])
    n = len(expected)
    assert len(ds) == -(-n // 8)
    assert ids[:n].tolist() == expected
    assert ids[n:].eq(tok.pad_token_id).all() and labels[n:].eq(-100).all()
    # positions reset at BOS (document starts) and at each row a document continues into (rows 16 and 24: the
    # documents starting at 11 and 19 are split there); pads continue the last document
    starts = ids[:n].eq(tok.bos_token_id).nonzero().flatten()
    assert starts.tolist() == [0, 11, 19]
    assert pos.eq(0).nonzero().flatten().tolist() == [0, 8, 11, 16, 19, 24]
    assert pos[n:].tolist() == list(range(int(pos[n - 1]) + 1, int(pos[n - 1]) + 1 + len(ids) - n))
    assert labels[pos.eq(0)].eq(-100).all()
    keep = torch.ones(len(ids), dtype=torch.bool)
    keep[pos.eq(0)] = False
    keep[n:] = False
    assert torch.equal(labels[keep], ids[keep])
    assert [
        tok.decode(ids[s:e].tolist()) for s, e in zip(starts.tolist(), [*starts[1:].tolist(), n])
    ] == texts

    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert all(v.shape == (2, 8) and v.dtype == torch.long for v in batch.values())
    assert dm.val_dataloader() == []


def test_text_files_val_split_and_no_bos(tmp_path):
    for i in range(10):
        (tmp_path / f"{i}.txt").write_text(f"document number {i}")
    dm = TextFilesDataModule([str(tmp_path)], seq_len=16, val_fraction=0.2, seed=1, add_bos=False)
    dm.setup("fit")
    eos = ByteTokenizer.eos_token_id
    n_docs = lambda ds: sum(int(ds[i]["input_ids"].eq(eos).sum()) for i in range(len(ds)))  # noqa: E731
    assert (n_docs(dm.train_dataset), n_docs(dm.val_dataset)) == (8, 2)
    assert not dm.train_dataset[0]["input_ids"].eq(ByteTokenizer.bos_token_id).any()
    again = TextFilesDataModule([str(tmp_path)], seq_len=16, val_fraction=0.2, seed=1, add_bos=False)
    again.setup("fit")
    assert torch.equal(again.val_dataset.packed["input_ids"], dm.val_dataset.packed["input_ids"])


def test_text_files_errors(tmp_path):
    with pytest.raises(ValueError, match=r"no \.txt or \.jsonl files found"):
        TextFilesDataModule([str(tmp_path)], seq_len=8).setup("fit")
    with pytest.raises(ValueError, match="do not exist"):
        TextFilesDataModule([str(tmp_path / "nope")], seq_len=8).setup("fit")
    (tmp_path / "x.jsonl").write_text(json.dumps({"body": "hi"}) + "\n")
    with pytest.raises(ValueError, match="has no key 'text'"):
        TextFilesDataModule([str(tmp_path)], seq_len=8).setup("fit")
    with pytest.raises(ValueError, match="val_fraction"):
        TextFilesDataModule([str(tmp_path)], val_fraction=1.0)


def test_text_files_local_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "hello": 4, "world": 5}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "d.txt").write_text("hello world hello")
    dm = TextFilesDataModule([str(tmp_path / "d.txt")], seq_len=8, tokenizer=str(tmp_path / "tok"))
    dm.setup("fit")
    assert dm.vocab_size == 6
    row = dm.train_dataset[0]
    assert row["input_ids"].tolist() == [1, 4, 5, 4, 2, 0, 0, 0]
    assert row["labels"].tolist() == [-100, 4, 5, 4, 2, -100, -100, -100]
    assert row["position_ids"].tolist() == list(range(8))
