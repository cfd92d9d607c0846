"""Makes the tokenizer test data (run once; CI reads only its outputs, and has no Python):

1. `tiny-tokenizer.json`: a byte-level BPE of 320 tokens with `<|endoftext|>`, trained by the
   Hugging Face `tokenizers` library on the first 2,000 lines of tiny-shakespeare.
2. The GPT-2 ids of a sample text from transformers' `GPT2TokenizerFast`, printed as a Rust
   array for `runtime/src/data/tokenizer.rs`. The Hugging Face hub is not reachable here, so
   GPT-2's `vocab.json` and `merges.txt` are rebuilt from the BPE ranks that tiktoken-rs bundles
   (`r50k_base.tiktoken`, the same ranks as GPT-2's files) the way transformers' own
   `TikTokenConverter` does; the encoding is then transformers' and `tokenizers`' (its GPT-2
   pre-tokenizer and merge loop), independent of tiktoken-rs's.

Run: /work/pyenv/bin/python tests/data/make_tokenizer_data.py PATH/TO/r50k_base.tiktoken
"""
import base64
import json
import os
import sys
import tempfile

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2TokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

HERE = os.path.dirname(os.path.abspath(__file__))
SHAKESPEARE = os.path.join(HERE, "..", "..", "examples", "data", "tiny-shakespeare.txt")

# Keep in step with GPT2_SAMPLE in runtime/src/data/tokenizer.rs.
GPT2_SAMPLE = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n\n"
    "  It's 2024; they'll say   \"naïve café\" costs $3.50 — 東京 🚀!\t<|endoftext|> end \n"
)


def tiny_tokenizer():
    with open(SHAKESPEARE, encoding="utf-8") as f:
        lines = f.read().splitlines()[:2000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    tok.save(os.path.join(HERE, "tiny-tokenizer.json"))
    sample = "First Citizen:\nYou are all resolved rather to die than to famish?"
    print("tiny-tokenizer.json: vocab", tok.get_vocab_size(), "endoftext", tok.token_to_id("<|endoftext|>"))
    print("  ids of", json.dumps(sample), "=", tok.encode(sample).ids)


def gpt2_files(tiktoken_path, out_dir):
    ranks = {}
    with open(tiktoken_path) as f:
        for line in f:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    byte_encoder = bytes_to_unicode()

    def as_text(b):
        return "".join(byte_encoder[x] for x in b)

    vocab = {as_text(t): r for t, r in ranks.items()}
    vocab["<|endoftext|>"] = 50256
    merges = []
    for token, rank in ranks.items():
        if len(token) == 1:
            continue
        splits = [
            (token[:i], token[i:], rank)
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        splits.sort(key=lambda m: (ranks[m[0]], ranks[m[1]]))
        merges.extend(splits)
    merges.sort(key=lambda m: m[2])
    with open(os.path.join(out_dir, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(out_dir, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
        for a, b, _ in merges:
            f.write(f"{as_text(a)} {as_text(b)}\n")


def gpt2_ids(tiktoken_path):
    with tempfile.TemporaryDirectory() as d:
        gpt2_files(tiktoken_path, d)
        tok = GPT2TokenizerFast(os.path.join(d, "vocab.json"), os.path.join(d, "merges.txt"))
        # The literal "<|endoftext|>" in the sample is a special token for transformers; parc
        # encodes text without special tokens, so split it off and encode it as plain text.
        ids = tok.encode(GPT2_SAMPLE, split_special_tokens=True)
        assert tok.decode(ids) == GPT2_SAMPLE
        assert tok.encode("Hello world") == [15496, 995]
        print(f"GPT2_SAMPLE ids ({len(ids)}):")
        print(ids)


if __name__ == "__main__":
    tiny_tokenizer()
    gpt2_ids(sys.argv[1])
