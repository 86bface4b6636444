"""Sampling text from a checkpoint (``forge generate``): what its reader (forge.read.reader) does
for it.

A forge checkpoint of a transformers model is a Hugging Face model directory: its model is
built from its config and filled by forge's weights reader (forge.checkpoint.weights), then
transformers' ``generate`` samples: a causal LM continues the prompt, an encoder-decoder (T5,
BART) reads the prompt with its encoder and writes with its decoder. A LoRA checkpoint's model
is its base with the adapter merged in (forge.checkpoint.adapter). Any other model is the
reader's, built through its run's config. A checkpoint of a model that does not generate
(a classifier) is refused with a pointer to ``forge predict``, and so is one without a tokenizer
(``forge predict`` generates from token ids).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from forge.read.errors import ReadUsageError
from forge.read.inputs import has_tokenizer, no_tokenizer
from forge.read.predict import (
    auto_class,
    checkpoint_model_label,
    continue_with_module,
    model_kind,
    module_logits,
    run_module,
)
from forge.wrappers import class_label

logger = logging.getLogger(__name__)

FROM_IDS = (
    "`forge predict CKPT --input FILE.jsonl --output OUT.jsonl` generates from lines of token "
    'ids, e.g. {"input_ids": [1, 2, 3]}'
)


def generate_text(
    reader: Any,
    prompt: str,
    *,
    num: int = 1,
    max_new_tokens: int = 80,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
) -> list[str]:
    """Sample ``num`` texts for ``prompt`` from the model and tokenizer of the ``reader``'s
    checkpoint (a forge.read.reader.CheckpointReader): a causal LM's prompt and continuation,
    or what an encoder-decoder writes for the prompt.

    A checkpoint that is no Hugging Face model directory (a plain module's, a wrapper's, a LoRA
    checkpoint of such a base) is built through its run's config and sampled one token at a
    time."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from forge.checkpoint.adapter import adapter_base, is_adapter_directory, load_adapter_model
    from forge.checkpoint.weights import hf_directory_problem, load_pretrained

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    checkpoint = reader.path
    adapter = is_adapter_directory(checkpoint)
    described = adapter_base(checkpoint, verify=False) if adapter else checkpoint
    problem = hf_directory_problem(described)
    if problem is not None:  # a module of the user's own (or a LoRA base that is one)
        if not has_tokenizer(checkpoint):
            raise no_tokenizer(checkpoint, checkpoint_model_label(checkpoint), FROM_IDS)
        return _generate_with_module(
            reader, AutoTokenizer.from_pretrained(checkpoint), problem, prompt, num,
            max_new_tokens, temperature, top_k, seed,
        )  # fmt: skip
    kind, architecture = check_generative(described)
    if not has_tokenizer(checkpoint):
        raise no_tokenizer(checkpoint, architecture, FROM_IDS)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if adapter:  # LoRA: its base with the adapter merged in
        model = load_adapter_model(checkpoint, auto_class(kind))
    else:
        model = load_pretrained(checkpoint, auto_class(kind))
    torch.manual_seed(seed)
    encoded = tokenizer(prompt or tokenizer.bos_token or "", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(
            **encoded,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=top_k if temperature > 0 else None,
            max_new_tokens=max_new_tokens,
            num_return_sequences=num,
            use_cache=True,  # training saves use_cache: false in the config (as HF's Trainer)
            pad_token_id=tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
        )
    return [tokenizer.decode(seq, skip_special_tokens=True) for seq in output]


def _generate_with_module(
    reader: Any,
    tokenizer: Any,
    problem: str,
    prompt: str,
    num: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
) -> list[str]:
    import torch

    model = run_module(reader, problem)
    ids = tokenizer(prompt or tokenizer.bos_token or "", return_tensors="pt")["input_ids"]
    if module_logits(model, ids[:, -1:]).dim() != 3:
        raise ReadUsageError(
            f"{reader.path} holds a {class_label(model)} whose logits are not a causal LM's "
            "[batch, tokens, vocabulary]: it does not generate text; `forge predict CKPT "
            "--input FILE.jsonl --output OUT.jsonl` writes its predictions"
        )
    torch.manual_seed(seed)
    texts = []
    for _ in range(num):
        new = continue_with_module(model, tokenizer, ids, max_new_tokens, temperature, top_k=top_k)
        texts.append(tokenizer.decode(ids[0].tolist() + new, skip_special_tokens=True))
    return texts


def check_generative(checkpoint: Path) -> tuple[str, str]:
    """The (kind, architecture) of a checkpoint whose model generates text (a causal LM or an
    encoder-decoder); any other is refused, naming what it is."""
    kind, architecture = model_kind(checkpoint)
    if kind in ("causal_lm", "seq2seq"):
        return kind, architecture
    hint = (
        "; `forge predict CKPT --input FILE.jsonl --output OUT.jsonl` writes its class labels"
        if kind == "classifier"
        else ""
    )
    raise ReadUsageError(f"{checkpoint} holds a {architecture}, which does not generate text{hint}")
