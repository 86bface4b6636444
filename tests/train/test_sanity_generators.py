"""The sanity pass changes nothing: Python's, numpy's and torch's random generators are as they
were after it, though its forward drew dropout masks and its loader shuffled. (A run with the
pass and one without differ only where nothing reseeds after the pass, which a run comparison
can miss; the states themselves cannot.)"""

from __future__ import annotations

import random

import numpy as np
import torch

from forge.train.sanity import run_sanity_pass
from tests.train.common import make_args, make_trainer


def generator_states() -> tuple:
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()


def test_the_sanity_pass_puts_every_generator_back(tmp_path):
    args = make_args(tmp_path, eval_strategy="steps", eval_steps=4, seed=5)
    trainer = make_trainer(args, train_size=16, eval_size=8)
    assert trainer.model_init().config.attention_dropout > 0  # its forward draws masks
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    before = generator_states()
    run_sanity_pass(trainer, 1)
    after = generator_states()
    assert after[0] == before[0]
    assert after[1] == before[1]
    assert torch.equal(after[2], before[2])
