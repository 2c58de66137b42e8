""" "gpt": a small character-level GPT trained on Python's own documentation.

The corpus is `pydoc_data.topics.topics`, shipped with the standard library, so it is
real English text available offline. Only printable ASCII and newline are kept, and the
vocabulary is that fixed 96-character alphabet rather than the characters a particular
Python version's docs happen to use, so the architecture never changes with the
interpreter. (The text itself does vary a little between Python versions.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cache, partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaptipe.models.data import Dataset
from adaptipe.models.spec import LayerSpec, ModelSpec, Split, check_choice, check_min, check_types

__all__ = ["ALPHABET", "GPTConfig", "decode", "encode", "gpt_spec"]

NAME = "gpt"
ALPHABET = "\n" + "".join(chr(code) for code in range(32, 127))
VOCAB_SIZE = len(ALPHABET)  # 96
TRAIN_FRACTION = 0.9
_INIT_STD = 0.02


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """``vocab_size`` is fixed by `ALPHABET`; it is a field so a spec's config round-trips."""

    block_size: int = 64
    d_model: int = 128
    n_head: int = 4
    n_layer: int = 4
    vocab_size: int = VOCAB_SIZE

    def __post_init__(self) -> None:
        check_types(NAME, self)
        for name in ("block_size", "d_model", "n_head", "n_layer"):
            check_min(NAME, name, getattr(self, name), 1)
        check_choice(NAME, "vocab_size", self.vocab_size, (VOCAB_SIZE,))
        divisors = tuple(h for h in range(1, self.d_model + 1) if self.d_model % h == 0)
        check_choice(NAME, "n_head", self.n_head, divisors)


def _init_linear(linear: nn.Linear, std: float = _INIT_STD) -> None:
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


class Embedding(nn.Module):
    """Token ids (B, T) -> token + learned position embeddings (B, T, d_model)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.token = nn.Embedding(config.vocab_size, config.d_model)
        self.position = nn.Embedding(config.block_size, config.d_model)
        nn.init.normal_(self.token.weight, mean=0.0, std=_INIT_STD)
        nn.init.normal_(self.position.weight, mean=0.0, std=_INIT_STD)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[-1]
        if length > self.block_size:
            raise ValueError(f"gpt: sequence length {length} exceeds block_size {self.block_size}")
        positions = torch.arange(length, device=tokens.device)
        embedded: Tensor = self.token(tokens) + self.position(positions)
        return embedded


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        _init_linear(self.qkv)
        _init_linear(self.proj, _INIT_STD / math.sqrt(2 * config.n_layer))  # GPT-2 residual scaling

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        heads = self.qkv(x).view(batch, length, 3, self.n_head, width // self.n_head)
        q, k, v = heads.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, heads, T, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: Tensor = self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return projected


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        width = config.d_model
        self.ln_attn = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)
        _init_linear(self.fc)
        _init_linear(self.fc_out, _INIT_STD / math.sqrt(2 * config.n_layer))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x))
        x = x + self.fc_out(F.gelu(self.fc(self.ln_mlp(x))))
        return x


class Head(nn.Module):
    """Final LayerNorm and projection to vocabulary logits (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.d_model)
        self.out = nn.Linear(config.d_model, config.vocab_size)
        _init_linear(self.out)

    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.out(self.ln(x))
        return logits


# ---- corpus ------------------------------------------------------------------------------

_BYTE_TO_ID = np.full(256, -1, dtype=np.int64)
_BYTE_TO_ID[np.frombuffer(ALPHABET.encode("ascii"), dtype=np.uint8)] = np.arange(VOCAB_SIZE)


def encode(text: str) -> Tensor:
    """Characters outside `ALPHABET` are dropped; returns int64 ids."""
    raw = np.frombuffer(text.encode("ascii", errors="ignore"), dtype=np.uint8)
    ids = _BYTE_TO_ID[raw]
    return torch.from_numpy(ids[ids >= 0].copy())


def decode(ids: Tensor) -> str:
    return "".join(ALPHABET[i] for i in ids.reshape(-1).tolist())


@cache
def corpus_ids() -> Tensor:
    """The whole corpus as ids: all documentation topics, in sorted key order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as error:  # some stripped-down Python builds omit it
        raise RuntimeError(
            "gpt: the corpus is the standard library's pydoc_data.topics, which this "
            "Python installation lacks"
        ) from error
    return encode("\n".join(topics[key] for key in sorted(topics)))


def _make_dataset(config: GPTConfig, split: Split) -> Dataset:
    """Non-overlapping windows of block_size + 1 characters: input [:-1], target [1:]."""
    ids = corpus_ids()
    cut = int(len(ids) * TRAIN_FRACTION)
    part = ids[:cut] if split == "train" else ids[cut:]
    window = config.block_size + 1
    windows = part[: len(part) // window * window].view(-1, window)
    return Dataset(
        windows[:, :-1].contiguous(), windows[:, 1:].contiguous(), name=f"{NAME}/{split}"
    )


# ---- spec --------------------------------------------------------------------------------


def _make_layer(config: GPTConfig, index: int) -> nn.Module:
    if index == 0:
        return Embedding(config)
    if index <= config.n_layer:
        return Block(config)
    return Head(config)


def _cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def gpt_spec(config: GPTConfig) -> ModelSpec:
    names_and_kinds = [("embedding", "Embedding")]
    names_and_kinds += [(f"block{i}", "Block") for i in range(config.n_layer)]
    names_and_kinds += [("head", "Head")]
    return ModelSpec(
        name=NAME,
        config=asdict(config),
        layers=tuple(
            LayerSpec(name=name, kind=kind, make=partial(_make_layer, config, index))
            for index, (name, kind) in enumerate(names_and_kinds)
        ),
        loss_fn=_cross_entropy,
        dataset_fn=partial(_make_dataset, config),
    )
