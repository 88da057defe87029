"""Decides when a request is done: EOS, stop token ids, stop strings, max_tokens.

Also keeps the request's detokenized text current (stop strings are cut from it).
"""

from __future__ import annotations

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


class StopChecker:
    def __init__(self, tokenizer: Any | None, *configs: Any) -> None:
        self.tokenizer = tokenizer
        self.eos = eos_token_ids(tokenizer, *configs)

    def check(self, req: Request) -> bool:
        """Update req's text and finish state after a new token; True when it finished."""
        p, tok = req.params, req.output_token_ids[-1]
        if self.tokenizer is not None:
            req.output_text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            return self._finish(req, "stop")
        for stop in p.stop:
            cut = req.output_text.find(stop)
            if stop and cut >= 0:
                req.output_text = req.output_text[:cut]
                return self._finish(req, "stop")
        if len(req.output_token_ids) >= p.max_tokens:
            return self._finish(req, "length")
        return False

    @staticmethod
    def _finish(req: Request, reason: str) -> bool:
        req.finished, req.finish_reason = True, reason
        return True
