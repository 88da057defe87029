"""Decides when a request is done (EOS, stop ids, stop strings, max_tokens) and detokenizes.

Owns each request's incremental detokenization state and the text it may show: a stop string is
cut from the text, and a tail that could still grow into a stop string is held back from
streaming until it cannot match. Knows nothing of scheduling or tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetier.core import Request


def eos_token_ids(*sources: Any) -> set[int]:
    """Union of `eos_token_id` (int or list) over configs and tokenizers that define one."""
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


@dataclass
class _Detok:
    """Incremental detokenization: text of ids[prefix:] minus text of ids[prefix:read]."""

    skip_special: bool
    prefix_offset: int = 0
    read_offset: int = 0
    sent: int = 0  # characters of output_text already handed out as deltas


class StopChecker:
    def __init__(self, tokenizer: Any | None, *configs: Any) -> None:
        self.tokenizer = tokenizer
        self.eos = eos_token_ids(tokenizer, *configs)
        self.specials: list[str] = list(getattr(tokenizer, "all_special_tokens", []) or [])
        self._state: dict[int, _Detok] = {}

    def _detok_state(self, req: Request) -> _Detok:
        st = self._state.get(req.request_id)
        if st is None:
            # Match stop strings on text with special tokens when a stop string names one.
            stops = req.params.stop
            names_special = any(sp and sp in stop for stop in stops for sp in self.specials)
            skip = req.params.skip_special_tokens and not names_special
            st = self._state[req.request_id] = _Detok(skip_special=skip)
        return st

    def _decode_new(self, req: Request, st: _Detok, end: int | None = None) -> tuple[str, str]:
        """(text the newest tokens (up to `end`) add, a pending tail): an incomplete UTF-8 tail
        ("\ufffd") stays pending until more tokens complete it or the request finishes."""
        ids, tok = req.output_token_ids[:end], self.tokenizer
        assert tok is not None
        prev = tok.decode(
            ids[st.prefix_offset : st.read_offset], skip_special_tokens=st.skip_special
        )
        full = tok.decode(ids[st.prefix_offset :], skip_special_tokens=st.skip_special)
        if len(full) <= len(prev):
            return "", ""
        if full.endswith("\ufffd"):
            return "", full[len(prev) :]
        st.prefix_offset, st.read_offset = st.read_offset, len(ids)
        return full[len(prev) :], ""

    def check(self, req: Request) -> bool:
        """Update req's text and finish state after a new token; True when it finished."""
        p, tok = req.params, req.output_token_ids[-1]
        st = self._detok_state(req)
        stop_token = (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids
        # With special tokens shown (skip_special_tokens=False) the token that ends the request
        # still adds no text, as in vLLM: a tool-call parser must not see "</s>".
        end = -1 if stop_token and not p.skip_special_tokens else None
        new, pending = self._decode_new(req, st, end) if self.tokenizer is not None else ("", "")
        req.output_text += new
        if stop_token:
            return self._finish(req, "stop", pending)
        # Stop strings are matched on the text including the pending tail, as a full decode would.
        tentative = req.output_text + pending
        cut = self._find_stop(tentative, len(new) + len(pending), p.stop)
        if cut >= 0:
            req.output_text = tentative[:cut]
            return self._finish(req, "stop")
        if len(req.output_token_ids) >= p.max_tokens:
            return self._finish(req, "length", pending)
        return False

    @staticmethod
    def _find_stop(text: str, new_chars: int, stops: list[str]) -> int:
        """Earliest start of a stop string that overlaps the newest `new_chars`, or -1."""
        cuts = []
        for stop in stops:
            if stop:
                at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
                if at >= 0:
                    cuts.append(at)
        return min(cuts) if cuts else -1

    @staticmethod
    def _finish(req: Request, reason: str, pending: str = "") -> bool:
        req.output_text += pending
        req.finished, req.finish_reason = True, reason
        return True

    def take_text(self, req: Request) -> str:
        """Text not yet handed out that can no longer turn into a stop string (all when done)."""
        st = self._detok_state(req)
        text = req.output_text
        limit = len(text)
        if not req.finished:
            for stop in req.params.stop:
                for k in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:k]):
                        limit = min(limit, len(text) - k)
                        break
        limit = max(limit, st.sent)
        out, st.sent = text[st.sent : limit], limit
        return out

    def forget(self, request_id: int) -> None:
        self._state.pop(request_id, None)
