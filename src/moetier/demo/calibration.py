"""The shipped calibration corpus and the dense model's MoE-input hidden states over it.

`calibration.txt` holds documents separated by lines `===`. A document whose first line starts
with `User:` is a dialogue and goes through the chat template; any other is plain text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

SEPARATOR = "\n===\n"
_ROLES = {"User: ": "user", "Assistant: ": "assistant"}


@dataclass
class MoEInputs:
    """Each layer's MoE input over the corpus and where documents continue.

    hidden: [layers, tokens, hidden] float32; follows_previous[t] is True when token t-1 is in
    the same document as token t.
    """

    hidden: torch.Tensor
    follows_previous: torch.Tensor


def load_corpus() -> list[str]:
    text = resources.files("moetier.demo").joinpath("calibration.txt").read_text("utf-8")
    return [doc.strip("\n") for doc in text.split(SEPARATOR) if doc.strip()]


def dialogue_messages(doc: str) -> list[dict[str, str]]:
    """`User: ...` / `Assistant: ...` lines as chat messages; other lines continue the last."""
    messages: list[dict[str, str]] = []
    for line in doc.split("\n"):
        role = next((r for prefix, r in _ROLES.items() if line.startswith(prefix)), None)
        if role is not None:
            messages.append({"role": role, "content": line.split(": ", 1)[1]})
        elif messages:
            messages[-1]["content"] += "\n" + line
    return messages


def _id_list(ids: Any) -> list[int]:
    """apply_chat_template's result (list, tensor or BatchEncoding, batch of one) as list[int]."""
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """A one-turn user prompt through the chat template, ready for the assistant's answer."""
    messages = [{"role": "user", "content": prompt}]
    return _id_list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def document_ids(doc: str, tokenizer: Any) -> list[int]:
    if doc.startswith("User: ") and getattr(tokenizer, "chat_template", None):
        return _id_list(tokenizer.apply_chat_template(dialogue_messages(doc)))
    return [int(i) for i in tokenizer(doc)["input_ids"]]


def corpus_ids(tokenizer: Any, max_tokens: int, max_doc_tokens: int = 512) -> list[list[int]]:
    """Token ids per document, each cut to max_doc_tokens, stopping at max_tokens in all."""
    docs: list[list[int]] = []
    total = 0
    for doc in load_corpus():
        ids = document_ids(doc, tokenizer)[: min(max_doc_tokens, max_tokens - total)]
        if len(ids) >= 2:
            docs.append(ids)
            total += len(ids)
        if total >= max_tokens:
            break
    return docs


def collect_moe_inputs(model: Any, docs: list[list[int]], progress: bool = True) -> MoEInputs:
    """Run the dense model over each document; record each layer's post-attention norm output."""
    layers = model.model.layers
    per_layer: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook_for(index: int) -> Any:
        def hook(module: Any, args: Any, output: torch.Tensor) -> None:
            per_layer[index].append(output.detach()[0].float().clone())

        return hook

    handles = [
        layer.post_attention_layernorm.register_forward_hook(hook_for(i))
        for i, layer in enumerate(layers)
    ]
    follows: list[torch.Tensor] = []
    bar = tqdm(
        total=sum(map(len, docs)), unit="tok", desc="calibrating routers", disable=not progress
    )
    try:
        with torch.inference_mode():
            for ids in docs:
                model.model(input_ids=torch.tensor([ids]), use_cache=False)
                cont = torch.ones(len(ids), dtype=torch.bool)
                cont[0] = False
                follows.append(cont)
                bar.update(len(ids))
    finally:
        bar.close()
        for handle in handles:
            handle.remove()
    hidden = torch.stack([torch.cat(chunks) for chunks in per_layer])
    log.info("calibration: %d documents, %d tokens", len(docs), hidden.shape[1])
    return MoEInputs(hidden=hidden, follows_previous=torch.cat(follows))
