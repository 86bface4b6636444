"""Models and datasets written for plain PyTorch: LossAdapter and TupleCollator in the trainer,
and the messages that point to them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import Dataset

from forge.data import TupleCollator
from forge.train import LossAdapter, Trainer
from forge.train.plain_models import as_model_output
from tests.train.common import make_args


class Pairs(Dataset):
    """Items ``(x, y)``, as a plain PyTorch dataset returns them."""

    def __init__(self, n: int = 32, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.y = torch.randint(3, (n,), generator=generator)
        self.x = torch.randn(n, 4, generator=generator) + self.y[:, None].float()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class Net(nn.Module):
    """forward(x, y) returns the loss as a bare tensor, forward(x) the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x, y=None):
        logits = self.body(x)
        return logits if y is None else nn.functional.cross_entropy(logits, y)


def test_loss_adapter_maps_what_forward_returns():
    loss, logits = torch.tensor(1.5), torch.zeros(2, 3)
    assert as_model_output(loss) == {"loss": loss}
    assert as_model_output(logits)["logits"] is logits
    assert as_model_output((loss, logits)) == {"loss": loss, "logits": logits}
    assert as_model_output((loss,)) == {"loss": loss}
    both = as_model_output([loss, logits, logits])
    assert both["loss"] is loss and both["logits"] == (logits, logits)
    assert as_model_output({"loss": loss}) == {"loss": loss}


def test_loss_adapter_builds_its_module_and_keeps_its_weight_names(tmp_path):
    torch.manual_seed(0)
    adapter = LossAdapter(Net)  # a builder, as a config's !partial gives it
    assert isinstance(adapter.module, Net)
    args = make_args(
        tmp_path,
        max_steps=4,
        save_strategy="steps",
        save_steps=4,
        eval_strategy="steps",
        eval_steps=4,
    )
    trainer = Trainer(
        adapter,
        args,
        Pairs(),
        eval_dataset=Pairs(8, seed=1),
        data_collator=TupleCollator(["x", "y"]),
    )
    output = trainer.train()
    assert output.metrics["eval_loss"] > 0  # y is no label name: the returned loss counts
    saved = load_file(tmp_path / "checkpoints" / "checkpoint-000004" / "model.safetensors")
    plain = Net()
    plain.load_state_dict(saved)  # the plain model's own names, no "module." prefix
    for name, tensor in adapter.module.state_dict().items():
        assert torch.equal(plain.state_dict()[name], tensor)


def test_tuple_batches_are_told_to_name_their_parts(tmp_path):
    trainer = Trainer(LossAdapter(Net()), make_args(tmp_path, max_steps=1), Pairs())
    with pytest.raises(TypeError) as err:
        trainer.train()
    message = str(err.value)
    assert "a list of 2 (the dataset's items are tuples" in message
    assert "data_collator: !singleton:forge.data:TupleCollator {names: [x, y]}" in message


def test_a_bare_loss_tensor_is_told_to_use_the_loss_adapter(tmp_path):
    trainer = Trainer(
        Net(), make_args(tmp_path, max_steps=1), Pairs(), data_collator=TupleCollator(["x", "y"])
    )
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert "Net.forward must return an object with .loss or a dict with 'loss' (got Tensor)" in (
        str(err.value)
    )
    assert "!partial:forge.train:LossAdapter" in str(err.value)


def test_bare_logits_are_told_to_use_compute_loss_func(tmp_path):
    class Head(Net):
        def forward(self, x, y=None):
            return self.body(x)  # predictions only

    trainer = Trainer(
        Head(), make_args(tmp_path, max_steps=1), Pairs(), data_collator=TupleCollator(["x", "y"])
    )
    with pytest.raises(ValueError, match=r"a tensor of shape \(4, 3\) is predictions, not a loss"):
        trainer.train()
