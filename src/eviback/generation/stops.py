"""Stop strings matched on token ids: a small automaton over the tokens' own texts, built once per tokenizer.

The rule is vLLM's, as every backend follows it (`eviback.generation.base`): generation stops after the
first token whose text completes a stop string. Deciding that by decoding the sampled tail at every step
costs a tokenizer call per row per step on the CPU; here the decision is one table look-up per row:

- a *state* is the longest tail of the text so far that is the beginning of some stop string (`""`, `"<"`,
  `"</sea"`, ...; a few dozen at most), plus one absorbing state "a stop string was completed";
- `table[state, token]` is the state after appending that token's text.

So a step costs `state = table[state, last_token]` for the whole batch, on whatever device the model is on,
and the step at which a row stopped is the first at which its state is the absorbing one. Each token's text
is its own decoding (special tokens included, no clean-up), and the text of a sequence is taken to be the
concatenation of its tokens' texts: true of byte-level BPE tokenizers (SmolLM2, Qwen, Llama 3) up to the
replacement characters of a multi-byte character split across tokens, which no ASCII stop string contains.
A stop string with leading spaces may be missed by a SentencePiece tokenizer that drops a token's leading
space when it is decoded alone; the Search-R1 tags (`</search>`, `</answer>`) have none.

    matcher = StopMatcher.for_tokenizer(tokenizer, ("</search>", "</answer>"))
    matcher.first_stop(ids)     # how many leading ids up to the completing token, or None

torch is imported only to put the table on a model's device: the matcher itself is numpy.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


class StopMatcher:
    """The automaton of one vocabulary and one set of stop strings (see the module docstring).

    Attributes:
        stops: the stop strings.
        states: the state strings; index 0 is "" and `matched` (= len(states)) is the absorbing state.
        table: (len(states) + 1, vocab) int array: the state after each token, from each state.
    """

    def __init__(self, token_texts: Sequence[str], stops: Sequence[str]) -> None:
        stops = tuple(s for s in stops if s)
        if not stops:
            raise ValueError("StopMatcher needs at least one non-empty stop string")
        self.stops = stops
        prefixes = sorted({s[:i] for s in stops for i in range(len(s))}, key=lambda p: (len(p), p))
        self.states: tuple[str, ...] = tuple(prefixes)  # "" first
        self.matched = len(self.states)
        vocab = len(token_texts)
        index = {p: i for i, p in enumerate(self.states)}
        table = np.zeros((self.matched + 1, vocab), dtype=np.int32)
        table[self.matched, :] = self.matched

        def step(state: str, text: str) -> int:
            s = state + text
            if any(stop in s for stop in stops):
                return self.matched
            for start in range(max(0, len(s) - len(self.states[-1])), len(s) + 1):
                if s[start:] in index:  # the longest tail that begins a stop string
                    return index[s[start:]]
            return 0

        # A token that holds none of the stop strings' first characters cannot start a match: from state ""
        # it leads back to "", and from any other state it can only continue that state's text. So only
        # the tokens with such a character are run through `step` from every state; the others are looked
        # up by the continuations each state can take (a sorted list, so "texts starting with c" is a range).
        firsts = {s[0] for s in stops}
        special = [t for t, text in enumerate(token_texts) if any(c in text for c in firsts)]
        for state_index, state in enumerate(self.states):
            for t in special:
                table[state_index, t] = step(state, token_texts[t])
        ordered = sorted((text, t) for t, text in enumerate(token_texts) if text)
        keys = [text for text, _ in ordered]
        special_set = set(special)
        for state_index, state in enumerate(self.states[1:], start=1):
            candidates: set[int] = set()
            for stop in stops:
                for start in range(len(state)):
                    tail = state[start:]
                    if not stop.startswith(tail):
                        continue
                    rest = stop[len(tail):]
                    # tokens that are a prefix of the rest: one exact look-up per prefix length
                    for k in range(1, len(rest) + 1):
                        lo = bisect.bisect_left(keys, rest[:k])
                        while lo < len(keys) and keys[lo] == rest[:k]:
                            candidates.add(ordered[lo][1])
                            lo += 1
                    # tokens that start with the whole rest (they complete the stop string)
                    lo = bisect.bisect_left(keys, rest)
                    while lo < len(keys) and keys[lo].startswith(rest):
                        candidates.add(ordered[lo][1])
                        lo += 1
            for t in candidates - special_set:
                table[state_index, t] = step(state, token_texts[t])
        self.table = table

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, stops: Sequence[str], vocab_size: int | None = None) -> StopMatcher:
        """The matcher of `tokenizer` (cached per tokenizer object and stop strings). `vocab_size`: the
        model's vocabulary when it is larger than the tokenizer's (ids past the tokenizer decode to "")."""
        return _cached(tokenizer, tuple(stops), vocab_size)

    def first_stop(self, ids: Sequence[int]) -> int | None:
        """The number of leading `ids` up to and including the token that completes a stop string, or None."""
        table, state = self.table, 0
        width = table.shape[1]
        for n, token in enumerate(ids, start=1):
            state = int(table[state, token]) if 0 <= token < width else 0
            if state == self.matched:
                return n
        return None

    def device_table(self, device: Any) -> torch.Tensor:
        """The table as a (states + 1, vocab) long tensor on `device` (cached per device)."""
        import torch

        key = str(device)
        cached = getattr(self, "_device_tables", None)
        if cached is None:
            cached = self._device_tables = {}
        if key not in cached:
            cached[key] = torch.as_tensor(self.table, dtype=torch.long, device=device)
        return cached[key]


def token_texts(tokenizer: Any, vocab_size: int | None = None) -> list[str]:
    """Each id's own decoding (special tokens kept, no clean-up); ids the tokenizer lacks decode to ""."""
    known = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(known)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    size = max(known, vocab_size or 0)
    return list(texts) + [""] * (size - known)


_cache: dict[tuple[int, tuple[str, ...], int | None], tuple[Any, StopMatcher]] = {}


def _cached(tokenizer: Any, stops: tuple[str, ...], vocab_size: int | None) -> StopMatcher:
    key = (id(tokenizer), stops, vocab_size)
    hit = _cache.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    matcher = _build(tokenizer, stops, vocab_size)
    _cache[key] = (tokenizer, matcher)
    return matcher


@functools.lru_cache(maxsize=8)
def _build_from_texts(texts: tuple[str, ...], stops: tuple[str, ...]) -> StopMatcher:
    return StopMatcher(texts, stops)


def _build(tokenizer: Any, stops: tuple[str, ...], vocab_size: int | None) -> StopMatcher:
    return _build_from_texts(tuple(token_texts(tokenizer, vocab_size)), stops)
