"""Which parts of a model the pipeline trainer splits: chosen from the model's class for the
common Hugging Face families, named in the config for any other model.

A preset names a family's parts (``ModelParts``) as its language-model class lays them out
(embedding -> layers -> head, and the rotary embedding):

- GPT-2, GPT-Neo: ``transformer.wte``, ``.wpe``, ``.drop`` -> ``transformer.h`` ->
  ``transformer.ln_f``, ``lm_head``
- GPT-NeoX: ``gpt_neox.embed_in``, ``.emb_dropout`` -> ``gpt_neox.layers`` ->
  ``gpt_neox.final_layer_norm``, ``lm_head``; ``gpt_neox.rotary_emb``
- OPT: ``model.decoder.embed_tokens``, ``.project_in``, ``.embed_positions`` ->
  ``model.decoder.layers`` -> ``.final_layer_norm``, ``.project_out``, ``lm_head``
- Llama and the decoders laid out like it (Mistral, Mixtral, Qwen2, Qwen3, Gemma, Phi-3,
  OLMo, OLMo-2, StableLM): ``model.embed_tokens`` -> ``model.layers`` -> ``model.norm``,
  ``lm_head``; ``model.rotary_emb``
- Phi: ``model.embed_tokens``, ``model.embed_dropout`` -> ``model.layers`` ->
  ``model.final_layernorm``, ``lm_head``; ``model.rotary_emb``
- BERT, RoBERTa masked LMs (encoders): ``bert.embeddings`` -> ``bert.encoder.layer`` -> ``cls``

Optional parts (OPT's projections and final norm, which some sizes lack) are kept only where
the model has them. Each key a config sets replaces the preset's. A model whose forward does
something its named modules do not (layers dropped at random, a router's auxiliary loss
added, an encoder-decoder) is refused with the reason, as is a model of no known family
whose parts the config does not name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from forge.train.pipeline.split import ModelParts
from forge.wrappers import class_label


@dataclass(frozen=True)
class Preset:
    """A family's part names; a name ending in ``?`` is kept only where the model has it."""

    embedding: tuple[str, ...]
    layers: str
    head: tuple[str, ...]
    rotary: str | None = None
    causal: bool = True

    def parts(self, model: nn.Module) -> ModelParts:
        named = dict(model.named_modules())

        def present(names: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(
                n.rstrip("?") for n in names if not n.endswith("?") or n.rstrip("?") in named
            )

        return ModelParts(
            embedding=present(self.embedding),
            layers=self.layers,
            head=present(self.head),
            rotary=self.rotary,
            causal=self.causal,
        )


_GPT2 = Preset(
    ("transformer.wte", "transformer.wpe", "transformer.drop"),
    "transformer.h",
    ("transformer.ln_f", "lm_head"),
)
_LLAMA = Preset(
    ("model.embed_tokens",), "model.layers", ("model.norm", "lm_head"), "model.rotary_emb"
)
PRESETS: dict[str, Preset] = {
    "GPT2LMHeadModel": _GPT2,
    "GPTNeoForCausalLM": _GPT2,
    "GPTNeoXForCausalLM": Preset(
        ("gpt_neox.embed_in", "gpt_neox.emb_dropout"),
        "gpt_neox.layers",
        ("gpt_neox.final_layer_norm", "lm_head?", "embed_out?"),  # embed_out before 4.50
        "gpt_neox.rotary_emb",
    ),
    "OPTForCausalLM": Preset(
        (
            "model.decoder.embed_tokens",
            "model.decoder.project_in?",
            "model.decoder.embed_positions",
        ),
        "model.decoder.layers",
        ("model.decoder.final_layer_norm?", "model.decoder.project_out?", "lm_head"),
    ),
    **dict.fromkeys(
        (
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "MixtralForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
            "GemmaForCausalLM",
            "Phi3ForCausalLM",
            "OlmoForCausalLM",
            "Olmo2ForCausalLM",
            "StableLmForCausalLM",
        ),
        _LLAMA,
    ),
    "PhiForCausalLM": Preset(
        ("model.embed_tokens", "model.embed_dropout"),
        "model.layers",
        ("model.final_layernorm", "lm_head"),
        "model.rotary_emb",
    ),
    "BertForMaskedLM": Preset(("bert.embeddings",), "bert.encoder.layer", ("cls",), causal=False),
    "RobertaForMaskedLM": Preset(
        ("roberta.embeddings",), "roberta.encoder.layer", ("lm_head",), causal=False
    ),
}

_KEYS = {
    "embedding": "pipeline_embedding",
    "layers": "pipeline_layers",
    "head": "pipeline_head",
    "rotary": "pipeline_rotary",
}


def preset_for(model: nn.Module) -> Preset | None:
    """The preset of the nearest class in ``model``'s class hierarchy that has one."""
    for cls in type(model).__mro__:
        if cls.__name__ in PRESETS:
            return PRESETS[cls.__name__]
    return None


def model_parts(model: nn.Module, named: dict[str, Any], key: str) -> tuple[ModelParts, list[str]]:
    """The parts to split ``model`` into (its preset, with every key of ``named`` that is not
    None in its place) and every problem with them; ``key`` prefixes the config keys."""
    refused = refusal(model, key)
    if refused:
        return ModelParts(), refused
    preset = preset_for(model)
    given = {field: named.get(config_key) for field, config_key in _KEYS.items()}
    if preset is None:
        missing = [_KEYS[f] for f in ("embedding", "layers", "head") if given[f] is None]
        if missing:
            return ModelParts(), [_unknown_family(model, missing, key)]
        parts = ModelParts(**given)
    else:
        base = preset.parts(model)
        parts = ModelParts(
            embedding=given["embedding"] or base.embedding,
            layers=given["layers"] or base.layers,
            head=given["head"] or base.head,
            rotary=given["rotary"] or base.rotary,
            causal=base.causal,
        )
    return parts, parts.problems(model, key)


def refusal(model: nn.Module, key: str) -> list[str]:
    """Why ``model`` cannot be split at all, whatever its parts are named (empty: it can). The
    message names the trainer's model (``trainer.model`` beside ``key``, ``trainer.args``): no
    training argument changes it, and ``forge train`` points at the line that sets the model."""
    config = getattr(model, "config", None)
    name = class_label(model)
    why = None
    if getattr(config, "is_encoder_decoder", False):
        why = "it is an encoder-decoder model (its decoder's layers take the encoder's output)"
    elif (getattr(config, "layerdrop", 0) or 0) > 0:
        why = (
            f"its forward skips layers at random (config.layerdrop {config.layerdrop}), which a "
            "stage cannot; set layerdrop: 0 in the model's config"
        )
    elif getattr(config, "output_router_logits", False):
        why = (
            "its forward adds the router's auxiliary loss (config.output_router_logits), which "
            "the last stage never sees; set output_router_logits: false in the model's config"
        )
    model_key = f"{key.rpartition('.')[0] or 'trainer'}.model"
    return [f"{model_key}: {name} cannot be split into pipeline stages: {why}"] if why else []


def _unknown_family(model: nn.Module, missing: list[str], key: str) -> str:
    name = class_label(model)
    guess = _likely_layers(model)
    hint = f" (its layers look like {guess!r})" if guess else ""
    known = ", ".join(sorted(PRESETS))
    return (
        f"{key}: forge knows no preset for {name} (presets: {known}); name its parts in "
        f"{', '.join(missing)}{hint}: pipeline_embedding the modules before the layers (the "
        "token embedding first), pipeline_layers the list of layers, pipeline_head the "
        "modules after them, pipeline_rotary a rotary embedding module or null"
    )


def _likely_layers(model: nn.Module) -> str | None:
    """The ModuleList or Sequential holding the most parameters: most likely the layers."""
    lists = [
        (sum(p.numel() for p in m.parameters()), n)
        for n, m in model.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1
    ]
    return max(lists)[1] if lists else None
