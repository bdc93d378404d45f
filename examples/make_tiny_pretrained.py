"""A tiny "pretrained" Llama and a corpus, on the local disk, to try the fine-tuning guide (docs/finetune.md)
on a laptop: the same folder layout as a real checkpoint, nothing downloaded.

Writes::

    OUT/llama/        config.json + model.safetensors (save_pretrained) + the tokenizer's files
    OUT/corpus.jsonl  one document per line ({"text": ...}), about 250 to 1,000 tokens each

The model is a 2-layer Llama with ``max_position_embeddings`` 256 (the length it was "pretrained" at) and
random weights standing in for trained ones; its byte-level BPE tokenizer is trained here on the corpus with
``tokenizers``. Each document states a code word in its first sentence and asks for it in its last, with
filler in between: recalling it is a long-range task (the Needle-in-a-haystack kind).

    python examples/make_tiny_pretrained.py --out tiny
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "the a river stone light garden window morning quiet old small red blue green north south city road "
    "bridge tower field forest letter story song voice hand door table market winter summer night day"
).split()
VERBS = "sees keeps finds carries opens follows builds remembers hears paints".split()


def _sentence(rng: random.Random) -> str:
    return f"{rng.choice(WORDS).capitalize()} {rng.choice(WORDS)} {rng.choice(VERBS)} {rng.choice(WORDS)}."


def corpus(docs: int, seed: int) -> list[str]:
    """``docs`` documents of 40 to 180 sentences, each with a code word stated first and asked for last."""
    rng = random.Random(seed)
    out = []
    for _ in range(docs):
        code = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6))
        body = " ".join(_sentence(rng) for _ in range(rng.randint(40, 180)))
        out.append(f"The code word is {code}. {body} What was the code word? It was {code}.")
    return out


def tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``texts``: BOS ``<s>``, EOS ``</s>``, PAD ``<pad>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def model(vocab_size: int, positions: int, tok, seed: int):
    """A 2-layer Llama (4 heads, 2 KV heads) with random weights, its special ids the tokenizer's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="tiny", help="folder to write llama/ and corpus.jsonl into")
    p.add_argument("--docs", type=int, default=200, help="documents in the corpus")
    p.add_argument("--positions", type=int, default=256, help="the model's max_position_embeddings")
    p.add_argument("--vocab-size", type=int, default=512, help="the tokenizer's (and the model's) vocabulary")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = corpus(args.docs, args.seed)
    with open(out / "corpus.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    tok = tokenizer(texts, args.vocab_size)
    lm = model(len(tok), args.positions, tok, args.seed)
    lm.save_pretrained(out / "llama")
    tok.save_pretrained(out / "llama")
    tokens = sum(len(ids) for ids in tok(texts)["input_ids"])
    print(
        f"wrote {out / 'llama'} (Llama, {lm.num_parameters():,} parameters, {args.positions} positions, "
        f"vocabulary {len(tok)}) and {out / 'corpus.jsonl'} ({len(texts)} documents, {tokens:,} tokens)"
    )


if __name__ == "__main__":
    main()
