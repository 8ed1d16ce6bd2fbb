"""Byte-level tokenizer and fixed-length language-modelling dataset (no downloads)."""

import numpy as np
import paddle

PAD, BOS, EOS = 0, 1, 2
OFFSET = 3  # byte b -> token b + OFFSET


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus pad/bos/eos: 259 ids, nothing to download."""

    vocab_size = 256 + OFFSET
    pad_token_id, bos_token_id, eos_token_id = PAD, BOS, EOS

    def encode(self, text):
        return [b + OFFSET for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode("utf-8", errors="replace")


class BlockDataset(paddle.io.Dataset):
    """Consecutive blocks of ``seq_length + 1`` tokens; ``labels`` are inputs shifted by one
    (PaddleNLP's llama criterion does not shift)."""

    def __init__(self, path, seq_length, tokenizer=None):
        tokenizer = tokenizer or ByteTokenizer()
        with open(path, encoding="utf-8") as f:
            ids = [BOS] + tokenizer.encode(f.read()) + [EOS]
        self.ids = np.asarray(ids, dtype="int64")
        self.seq_length = seq_length
        self.n = (len(self.ids) - 1) // seq_length
        if self.n == 0:
            raise ValueError(f"{path}: fewer than {seq_length + 1} tokens")

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        block = self.ids[i * self.seq_length : (i + 1) * self.seq_length + 1]
        return {"input_ids": block[:-1], "labels": block[1:]}
