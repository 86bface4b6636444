"""The keys a Hugging Face model config (a ``PreTrainedConfig`` subclass of transformers) takes.

Such a class takes any keyword: a name it does not declare becomes an attribute that no model
reads, so ``BartConfig(encoder_layres=2)`` builds the default 12 layers without a word. The
check of a config (forge/config/check.py) refuses such a key, with the names the class takes:
its fields, its ``attribute_map`` aliases (``hidden_size`` for ``d_model``), what its
``__post_init__`` (and transformers' base class's) reads from the extra keywords (``num_labels``,
``torch_dtype``, legacy names such as ``rope_scaling``), the generation settings the base class
accepts and drops, and the common keywords transformers' config documentation lists.

Only classes of the transformers package are held to this: a project's own config class may
keep extra attributes on purpose. Nothing here imports torch or transformers: the class given
was imported by the config's resolver already.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import sys
from typing import Any

#: the keywords transformers' ``PretrainedConfig`` documentation calls common to all models
#: (4.x), which models and generation still read where they are set
COMMON_KEYWORDS = (
    "add_cross_attention",
    "architectures",
    "bad_words_ids",
    "begin_suppress_tokens",
    "bos_token_id",
    "chunk_size_feed_forward",
    "cross_attention_hidden_size",
    "decoder_start_token_id",
    "diversity_penalty",
    "do_sample",
    "dtype",
    "early_stopping",
    "encoder_no_repeat_ngram_size",
    "eos_token_id",
    "exponential_decay_length_penalty",
    "finetuning_task",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "id2label",
    "is_decoder",
    "is_encoder_decoder",
    "label2id",
    "length_penalty",
    "max_length",
    "min_length",
    "no_repeat_ngram_size",
    "num_beam_groups",
    "num_beams",
    "num_labels",
    "num_return_sequences",
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "pad_token_id",
    "prefix",
    "problem_type",
    "pruned_heads",
    "remove_invalid_values",
    "repetition_penalty",
    "return_dict",
    "return_dict_in_generate",
    "sep_token_id",
    "suppress_tokens",
    "task_specific_params",
    "temperature",
    "tf_legacy_loss",
    "tie_encoder_decoder",
    "tie_word_embeddings",
    "tokenizer_class",
    "top_k",
    "top_p",
    "torch_dtype",
    "torchscript",
    "typical_p",
    "use_bfloat16",
    "attn_implementation",
    "name_or_path",
    "transformers_version",
)

# what a config class's code reads from its extra keywords
_READS = re.compile(r"""kwargs(?:\.(?:pop|get)\(|\[)\s*["'](\w+)["']|["'](\w+)["']\s+in\s+kwargs""")


def is_transformers_config(target: Any) -> bool:
    """Whether ``target`` is a model config class of the transformers package."""
    if not isinstance(target, type):
        return False
    bases = [c for c in target.__mro__ if c.__name__ in ("PreTrainedConfig", "PretrainedConfig")]
    return bool(bases) and (target.__module__ or "").startswith("transformers.")


@functools.cache
def config_keywords(target: type) -> frozenset[str]:
    """Every keyword ``target`` (a transformers config class) takes and makes use of."""
    names = set(COMMON_KEYWORDS)
    try:
        names.update(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        pass
    for cls in target.__mro__:
        if dataclasses.is_dataclass(cls):  # its fields, not its class variables
            names.update(f.name for f in dataclasses.fields(cls))
        names.update(getattr(cls, "attribute_map", {}) or {})
        for method in ("__init__", "__post_init__", "convert_rope_params_to_dict"):
            code = cls.__dict__.get(method)
            if code is None:
                continue
            try:
                source = inspect.getsource(code)
            except (OSError, TypeError):
                continue
            names.update(a or b for a, b in _READS.findall(source))
    names.update(_generation_defaults(target))
    names.update(getattr(target, "sub_configs", {}) or {})
    names.discard("self")
    return frozenset(n for n in names if not n.startswith("_"))


def _generation_defaults(target: type) -> list[str]:
    """The generation settings a config accepts and drops (transformers moves them to the
    model's ``generation_config``)."""
    for cls in target.__mro__:
        module = sys.modules.get(cls.__module__)
        generation = getattr(module, "GenerationConfig", None)
        defaults = getattr(generation, "_get_default_generation_params", None)
        if callable(defaults):
            try:
                return list(defaults())
            except Exception:  # another transformers: the common keywords cover them
                return []
    return []
