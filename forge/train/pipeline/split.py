"""Splitting a model into pipeline stages by module name.

A model the pipeline trainer splits names three parts (``ModelParts``): the token embedding,
the list of layers and the head modules that follow them, plus optionally the rotary position
embedding every layer takes. The defaults name those of Hugging Face's Llama-style decoders
(``LlamaForCausalLM``, Mistral, Qwen2, ...): ``model.embed_tokens``, ``model.layers``,
``model.norm`` + ``lm_head``, ``model.rotary_emb``. Stage 0 runs the embedding and its layers,
the last stage its layers and the head; the layers are split evenly or where the config says.

A stage's model is the full model with every other part removed, so its parameter names are
the unsplit model's (``model.layers.2.mlp.up_proj.weight``): checkpoints, optimizer state and
exports are keyed by them. ``StageModule`` is the forward one stage runs.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from forge.suggest import suggestion
from forge.train.pipeline.stage_init import keeps, tie_groups, with_tie_owners
from forge.wrappers import class_label


@dataclass(frozen=True)
class ModelParts:
    """Where a model keeps the parts a pipeline splits (module names, dotted).

    ``embedding``: the modules before the layers, run in order by the first stage: the first
    maps the token ids to vectors; a later ``nn.Embedding`` is a learned position embedding,
    called on the positions and added (GPT-2's ``wpe``); any other module (dropout, a
    projection) is applied to the vectors. ``layers``: the list of layers. ``head``: the
    modules after them, run in order by the last stage. ``rotary``: the rotary embedding every
    layer takes, or None. ``causal``: whether the layers attend causally (decoders) or to
    every position (encoders).
    """

    embedding: tuple[str, ...] = ("model.embed_tokens",)
    layers: str = "model.layers"
    head: tuple[str, ...] = ("model.norm", "lm_head")
    rotary: str | None = "model.rotary_emb"
    causal: bool = True

    def __post_init__(self) -> None:
        for name in ("embedding", "head"):  # one name, as a config may give it
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))

    def problems(self, model: nn.Module, key: str) -> list[str]:
        """What is wrong with these names for ``model``; ``key`` prefixes the config keys."""
        found: list[str] = []
        named = dict(model.named_modules())
        candidates = sorted(n for n in named if n)
        for field, name, what in (
            *(
                (
                    "pipeline_embedding",
                    e,
                    "a module before the layers" if i else "its token embedding",
                )
                for i, e in enumerate(self.embedding)
            ),
            ("pipeline_layers", self.layers, "its list of layers"),
            *(("pipeline_head", h, "the modules after the layers") for h in self.head),
            ("pipeline_rotary", self.rotary, "its rotary embedding, or null"),
        ):
            if name is None or name in named:
                continue
            found.append(
                f"{key}.{field}: {class_label(model)} has no module {name!r} (name {what})"
                + suggestion(name, candidates)
            )
        uncovered = sorted(
            {
                name.rpartition(".")[0]
                # a head whose weight is tied to the embedding counts too: it must run
                for name, _ in model.named_parameters(remove_duplicate=False)
                if not keeps(name.rpartition(".")[0], self.all_modules)
            }
        )
        if uncovered and not found:
            found.append(
                f"{key}: {class_label(model)} has parameters in {_few(uncovered)}, which no "
                "stage would hold; name them in pipeline_embedding, pipeline_layers or "
                "pipeline_head"
            )
        layers = named.get(self.layers)
        if layers is not None and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
            found.append(
                f"{key}.pipeline_layers: {self.layers!r} is a {type(layers).__name__}, not a "
                "ModuleList or Sequential of layers"
            )
        elif layers is not None and len(layers):
            found += self._call_problems(model, layers, key)
        return found

    @property
    def all_modules(self) -> list[str]:
        """Every named part (the modules some stage holds)."""
        return [*self.embedding, self.layers, *self.head, *([self.rotary] if self.rotary else [])]

    def _call_problems(self, model: nn.Module, layers: nn.Module, key: str) -> list[str]:
        """Whether a stage can call these layers as the unsplit model does."""
        found = []
        hf = _hf_config(model, self.layers)
        given = set(_layer_keywords(hf is not None, self.rotary is not None))
        for layer in {type(layer): layer for layer in layers}.values():
            needs = [n for n in _required_keywords(layer) if n not in given]
            if needs:
                found.append(
                    f"{key}.pipeline_layers: {type(layer).__name__}.forward needs "
                    f"{', '.join(map(repr, needs))}, which a pipeline stage does not give its "
                    f"layers (it gives the hidden states{''.join(', ' + g for g in sorted(given))}"
                    f"); {class_label(model)} cannot be split into pipeline stages"
                )
        kinds = sorted({str(k) for k in getattr(hf, "layer_types", None) or ()} - set(_MASKS))
        if kinds and self.causal:
            found.append(
                f"{key}.pipeline_layers: {class_label(model)}'s layers attend as "
                f"{', '.join(map(repr, kinds))}, which a pipeline stage cannot reproduce "
                f"(it builds {', '.join(map(repr, _MASKS))} masks)"
            )
        return found

    def num_layers(self, model: nn.Module) -> int:
        return len(model.get_submodule(self.layers))


# The attention masks a stage builds for a Hugging Face decoder layer, by the layer's
# attention kind (``config.layer_types``), as the unsplit model's forward builds them.
_MASKS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
}


def _hf_config(model: nn.Module, layers: str = "") -> Any:
    """The Hugging Face config of the model whose ``layers`` these are (its layers take masks
    and positions), else None: ``model`` itself, or the Hugging Face model a wrapper holds on
    the way to its layers (``lm.model`` for ``lm.model.layers``)."""
    from forge.train.pipeline.stage_init import _is_hf_model

    names = layers.split(".")[:-1] if layers else []
    for depth in range(len(names), -1, -1):
        owner = model.get_submodule(".".join(names[:depth])) if depth else model
        if _is_hf_model(owner):
            return owner.config
    return None


def _layer_keywords(hf: bool, rotary: bool) -> tuple[str, ...]:
    """The keywords a stage gives each layer (besides the hidden states)."""
    if not hf:
        return ()
    return ("attention_mask", "position_ids", *(("position_embeddings",) if rotary else ()))


def _required_keywords(layer: nn.Module) -> list[str]:
    """The parameters of ``layer.forward`` after the first that have no default."""
    try:
        params = list(inspect.signature(layer.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def _few(names: list[str], n: int = 3) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


@dataclass(frozen=True)
class StageSpec:
    """Which layers one pipeline stage runs, and whether it is the first or last."""

    index: int
    num_stages: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    def module_names(self, parts: ModelParts) -> list[str]:
        """The modules this stage holds (their weights are its share of the checkpoint)."""
        names = [f"{parts.layers}.{i}" for i in self.layers]
        if self.first:
            names[:0] = parts.embedding
        if self.last:
            names += list(parts.head)
        if parts.rotary is not None:
            names.append(parts.rotary)
        return names


class SplitError(ValueError):
    """The requested split does not fit the model; ``problems`` says why."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def split_layers(
    num_layers: int,
    num_stages: int,
    split: Sequence[str] | None,
    parts: ModelParts,
    key: str,
) -> list[StageSpec]:
    """The stages: ``split`` names the layer where each stage after the first begins
    (``model.layers.2``); None splits the layers evenly (earlier stages take the remainder)."""
    if num_stages > num_layers:
        raise SplitError(
            [
                f"{key}.pipeline_parallel_size: {num_stages} pipeline stages but the model has "
                f"only {num_layers} layers ({parts.layers}); use at most {num_layers} stages "
                "(pipeline_parallel_size, null for every process, x pipeline_stages_per_rank): "
                "start fewer processes, or set pipeline_parallel_size and the others train as "
                "data-parallel replicas"
            ]
        )
    if split is None:
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (i < extra) for i in range(num_stages)]
        starts = [sum(sizes[:i]) for i in range(num_stages)]
    else:
        starts = [0, *_split_starts(split, num_layers, num_stages, parts, key)]
    ends = starts[1:] + [num_layers]
    return [
        StageSpec(i, num_stages, range(start, end))
        for i, (start, end) in enumerate(zip(starts, ends, strict=True))
    ]


def _split_starts(
    split: Sequence[str], num_layers: int, num_stages: int, parts: ModelParts, key: str
) -> list[int]:
    problems: list[str] = []
    if len(split) != num_stages - 1:
        problems.append(
            f"{key}.pipeline_split names {len(split)} stage start(s) for {num_stages} stages; "
            f"name the first layer of every stage but the first ({num_stages - 1} names)"
        )
    starts: list[int] = []
    valid = [f"{parts.layers}.{i}" for i in range(1, num_layers)]
    for name in split if valid else ():
        prefix, _, index = str(name).rpartition(".")
        if prefix != parts.layers or not index.isdigit() or not 0 < int(index) < num_layers:
            problems.append(
                f"{key}.pipeline_split: {name!r} is not a layer where a stage can begin; use "
                f"one of {valid[0]!r} ... {valid[-1]!r}" + suggestion(str(name), valid)
            )
            continue
        starts.append(int(index))
    if not problems and starts != sorted(set(starts)):
        problems.append(
            f"{key}.pipeline_split: stage starts {list(split)} must be in increasing order, "
            "each layer once"
        )
    if problems:
        raise SplitError(problems)
    return starts


@dataclass(frozen=True)
class PipelineLayout:
    """Every stage of the pipeline and which rank of a replica runs it.

    With ``v`` stages per rank, rank ``r`` of ``n`` runs stages ``r, r + n, r + 2n, ...``
    (the looped placement the interleaved schedules expect).
    """

    parts: ModelParts
    stages: tuple[StageSpec, ...]
    num_ranks: int

    def rank_stages(self, pp_rank: int) -> list[StageSpec]:
        return [s for s in self.stages if s.index % self.num_ranks == pp_rank]

    def rank_modules(self, pp_rank: int) -> list[str]:
        return [n for s in self.rank_stages(pp_rank) for n in s.module_names(self.parts)]

    def holders(self, model: nn.Module) -> tuple[dict[str, int], dict[str, list[int]]]:
        """For the whole model (a meta skeleton will do): which rank writes each state-dict
        key (the first rank holding it; keys that alias another one are left out, as
        ``save_pretrained`` leaves out tied weights), and the parameters several ranks hold
        (a tied embedding), with those ranks."""
        ties = tie_groups(model)
        held = [with_tie_owners(self.rank_modules(r), ties) for r in range(self.num_ranks)]
        module_of: dict[int, list[str]] = {}
        for group in ties:
            for module_name, module, attr, is_param in group:
                table = module._parameters if is_param else module._buffers
                module_of.setdefault(id(table[attr]), []).append(module_name)

        def ranks_holding(tensor: torch.Tensor) -> list[int]:
            names = module_of.get(id(tensor), [])
            return [r for r in range(self.num_ranks) if any(keeps(n, held[r]) for n in names)]

        writer: dict[str, int] = {}
        seen: set[int] = set()
        for key, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            ranks = ranks_holding(tensor)
            if ranks:
                writer[key] = ranks[0]
        shared = {}
        for name, param in model.named_parameters():
            ranks = ranks_holding(param)
            if len(ranks) > 1:
                shared[name] = ranks
        return writer, shared


def prune_to_stages(model: nn.Module, parts: ModelParts, specs: Sequence[StageSpec]) -> None:
    """Remove every part no stage of ``specs`` holds; the rest keep their full names.

    The layer list becomes a ``ModuleDict`` keyed by the original indices, so layer 2 stays
    ``model.layers.2`` (a ModuleList would renumber it). A part that also holds a tensor of a
    kept part (an input embedding tied to the output head) stays, holding only that tensor.
    """
    held_layers = sorted({i for spec in specs for i in spec.layers})
    layers = model.get_submodule(parts.layers)
    if isinstance(layers, nn.ModuleDict):  # pruned before (a module trained again)
        kept_layers = nn.ModuleDict({str(i): layers[str(i)] for i in held_layers})
    else:
        kept_layers = nn.ModuleDict({str(i): layers[i] for i in held_layers})
    _set_submodule(model, parts.layers, kept_layers)
    first = any(spec.first for spec in specs)
    last = any(spec.last for spec in specs)
    for name, held in (*((e, first) for e in parts.embedding), *((h, last) for h in parts.head)):
        module = model.get_submodule(name)
        if not held and all(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            _set_submodule(model, name, None)
    _drop_meta_tensors(model)


def _drop_meta_tensors(model: nn.Module) -> None:
    """Remove the tensors left on the meta device: those of a module kept only for a tied
    tensor it shares with a kept part (a wrapper whose token embedding is tied to the head
    also holds a position embedding no stage here runs). A stage holds no tensor without data.
    """
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr in [a for a, t in table.items() if t is not None and t.is_meta]:
                del table[attr]
                module._non_persistent_buffers_set.discard(attr)


def _set_submodule(model: nn.Module, name: str, module: nn.Module | None) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent._modules[attr] = module


class StageModule(nn.Module):
    """The forward of one pipeline stage: embedding (first stage), its layers, head (last).

    The embedding modules run as ``ModelParts`` says. A Hugging Face model's layers get what
    its own forward gives them: the attention mask of their kind (causal, sliding window or
    chunked, from the model's config; none for an encoder), the position ids and, with a
    rotary module, the position embeddings; each takes those it names (or all, with
    ``**kwargs``). Other layers are called on the hidden states alone. A layer or head module
    that returns a tuple passes on its first element.
    """

    def __init__(self, model: nn.Module, parts: ModelParts, spec: StageSpec) -> None:
        super().__init__()
        self.spec = spec
        self.causal = parts.causal
        self.embedding = (
            nn.ModuleList(model.get_submodule(name) for name in parts.embedding)
            if spec.first
            else None
        )
        self.layers = nn.ModuleList(model.get_submodule(f"{parts.layers}.{i}") for i in spec.layers)
        self.head = (
            nn.ModuleList(model.get_submodule(name) for name in parts.head) if spec.last else None
        )
        self.rotary = model.get_submodule(parts.rotary) if parts.rotary else None
        self.config = _hf_config(model, parts.layers)
        given = _layer_keywords(self.config is not None, self.rotary is not None)
        self._keywords = [_accepted(layer, given) for layer in self.layers]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self._embed(inputs) if self.embedding is not None else inputs
        if self.config is not None:
            hidden = self._decoder_layers(hidden)
        else:
            for layer in self.layers:
                hidden = _first(layer(hidden))
        for module in self.head or ():
            hidden = _first(module(hidden))
        return hidden

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        token, *rest = self.embedding
        hidden = token(ids)
        for module in rest:
            if isinstance(module, nn.Embedding):
                hidden = hidden + _embed_positions(module, _positions(ids))
            else:
                hidden = module(hidden)
        return hidden

    def _decoder_layers(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = _positions(hidden)
        given: dict[str, Any] = {"position_ids": positions}
        if self.rotary is not None:
            given["position_embeddings"] = self.rotary(hidden, positions)
        masks: dict[str, Any] = {}
        first = hidden  # the masks need only its shape, dtype and device
        for index, layer, keywords in zip(
            self.spec.layers, self.layers, self._keywords, strict=True
        ):
            kwargs = {k: given[k] for k in keywords if k in given}
            if "attention_mask" in keywords:
                kwargs["attention_mask"] = self._mask(index, first, positions, masks)
            hidden = _first(layer(hidden, **kwargs))
        return hidden

    def _mask(self, index: int, hidden: torch.Tensor, positions: torch.Tensor, masks: dict) -> Any:
        """Layer ``index``'s attention mask (None where the attention needs none: an encoder
        without padding, or one ``is_causal`` covers), built once per kind and forward."""
        if not self.causal:
            return None
        kind = attention_kind(self.config, index)
        if kind not in masks:
            import transformers.masking_utils as masking

            build = getattr(masking, _MASKS[kind])
            masks[kind] = build(
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=None,
                position_ids=positions,
                **{_cache_keyword(build): None},
            )
        return masks[kind]


@functools.cache
def _cache_keyword(build: Callable[..., Any]) -> str:
    """The name a transformers mask builder takes its cache under: ``cache`` in newer releases
    (which still take ``past_key_values``, with a FutureWarning), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(build).parameters else "past_key_values"


def attention_kind(config: Any, index: int) -> str:
    """How layer ``index`` attends: its ``config.layer_types`` entry, else a sliding window
    where the config sets one (Mistral), else full causal attention."""
    types = getattr(config, "layer_types", None)
    if types:
        return str(types[index])
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def _accepted(layer: nn.Module, given: Sequence[str]) -> tuple[str, ...]:
    """Those of ``given`` that ``layer.forward`` takes (all of them with ``**kwargs``)."""
    try:
        params = inspect.signature(layer.forward).parameters.values()
    except (TypeError, ValueError):
        return tuple(given)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return tuple(given)
    names = {p.name for p in params}
    return tuple(k for k in given if k in names)


def _positions(like: torch.Tensor) -> torch.Tensor:
    """Positions 0..T-1 of a (batch, T, ...) tensor, shaped (1, T)."""
    return torch.arange(like.shape[1], device=like.device).unsqueeze(0)


def _embed_positions(module: nn.Embedding, positions: torch.Tensor) -> torch.Tensor:
    """A learned position embedding on ``positions``. Hugging Face's that take the attention
    mask first and the positions as ``position_ids`` (OPT's, which offsets them) get both."""
    try:
        takes_ids = "position_ids" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        takes_ids = False
    if takes_ids:
        return module(torch.ones_like(positions), position_ids=positions)
    return module(positions)


def _first(output: torch.Tensor | tuple) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each position's prediction of the next token; label -100 is
    ignored (Hugging Face's causal-LM loss: the labels are the inputs, shifted here)."""
    logits = logits.float()
    shifted = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        shifted.reshape(-1).to(logits.device),
        ignore_index=-100,
    )
