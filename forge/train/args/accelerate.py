"""What the Accelerate trainer's arguments add to ``TrainingArguments``: Accelerate's own
settings (mixed precision, ``split_batches``, ``dispatch_batches``)."""

from __future__ import annotations

from dataclasses import dataclass

from forge.train.args.names import SHARDING_UNSUPPORTED
from forge.train.args.training import TrainingArguments

MIXED_PRECISION = ("no", "fp16", "bf16")


@dataclass
class AccelTrainingArguments(TrainingArguments):
    """TrainingArguments plus Accelerate's own settings.

    ``mixed_precision`` (``no``, ``fp16``, ``bf16``) defaults to what ``bf16`` / ``fp16``
    say. ``split_batches``: ``per_device_train_batch_size`` (and the eval one) is the batch of
    all processes together, split evenly between them (Accelerate's meaning), instead of each
    process's. ``dispatch_batches`` is Accelerate's option for iterable datasets read on the main
    process; forge's loaders give every process its own shard (of a map-style dataset or of a
    stream), so only null / false apply.
    """

    mixed_precision: str | None = None
    split_batches: bool = False
    dispatch_batches: bool | None = None

    def validate(self) -> list[str]:
        p = super().validate()
        for name in ("fsdp", "fsdp_config"):
            if getattr(self, name) not in (None, "", False, [], {}):
                p.append(
                    f"{self._key(name)} does not apply to this trainer: {SHARDING_UNSUPPORTED}"
                )
        self._bool("split_batches", p)
        if self.split_batches is True and self.max_tokens_per_batch is not None:
            p.append(
                f"{self._key('split_batches')} splits a batch of a fixed size between the "
                "processes, and max_tokens_per_batch forms each process's batches by their "
                "token count; set one of them"
            )
        if self.mixed_precision is None:
            self.mixed_precision = "bf16" if self.bf16 else "fp16" if self.fp16 else "no"
        elif self.mixed_precision not in MIXED_PRECISION:
            self._choice("mixed_precision", MIXED_PRECISION, p, fix="or null to follow bf16/fp16")
        else:
            implied = "bf16" if self.bf16 else "fp16" if self.fp16 else None
            if implied is not None and implied != self.mixed_precision:
                p.append(
                    f"{self._key('mixed_precision')} is {self.mixed_precision!r} but "
                    f"{self._key(implied)} is true; set one of them"
                )
            self.bf16 = self.mixed_precision == "bf16"
            self.fp16 = self.mixed_precision == "fp16"
        if self.dispatch_batches not in (None, False):
            p.append(
                f"{self._key('dispatch_batches')} must be null or false (got "
                f"{self.dispatch_batches!r}): forge's loaders give every process its own shard, "
                "of a map-style dataset or of a stream"
            )
        return p
