from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from forge.data import load_or_train_tokenizer, stdlib_dir
from forge.data import tokenizer as tokenizer_module
from forge.data.tokenizer import EOS_TOKEN, TRAINING_INFO, tokenizer_cache_path

SAMPLE = (stdlib_dir() / "functools.py").read_text(encoding="utf-8")[:2000]


def test_trains_into_a_hugging_face_directory(
    small_tokenizer, tokenizer_cache: Path, tokenizer_settings: dict
) -> None:
    vocab_size = tokenizer_settings["vocab_size"]
    target = tokenizer_cache_path(tokenizer_cache, vocab_size)
    assert target.name == f"tokenizer-bpe-{vocab_size}"
    assert {"tokenizer.json", "tokenizer_config.json", TRAINING_INFO} <= {
        p.name for p in target.iterdir()
    }
    info = json.loads((target / TRAINING_INFO).read_text())
    assert info["num_files"] == tokenizer_settings["max_files"]
    assert info["vocab_size"] == len(small_tokenizer) == vocab_size
    assert small_tokenizer.eos_token == small_tokenizer.bos_token == EOS_TOKEN
    assert small_tokenizer.pad_token_id == small_tokenizer.eos_token_id == 0
    assert small_tokenizer.model_max_length == 2048
    assert not [p for p in tokenizer_cache.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("text", [SAMPLE, "def f(x):\n\treturn x  # λ → ☃\r\n", "   \n\n"])
def test_round_trips_text(small_tokenizer, text: str) -> None:
    ids = small_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert small_tokenizer.decode(ids) == text
    assert EOS_TOKEN not in small_tokenizer.decode(ids)


def test_learns_merges(small_tokenizer) -> None:
    ids = small_tokenizer(SAMPLE, add_special_tokens=False)["input_ids"]
    assert len(ids) < 0.75 * len(SAMPLE.encode())


def test_reuses_the_cache_without_retraining(
    small_tokenizer,
    tokenizer_cache: Path,
    tokenizer_settings: dict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target = tokenizer_cache_path(tokenizer_cache, tokenizer_settings["vocab_size"])
    stamp = (target / "tokenizer.json").stat().st_mtime_ns

    def refuse(*args, **kwargs):
        raise AssertionError("the cached tokenizer was retrained")

    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", refuse)
    again = load_or_train_tokenizer(tokenizer_cache, **tokenizer_settings)
    assert (target / "tokenizer.json").stat().st_mtime_ns == stamp
    assert again.get_vocab() == small_tokenizer.get_vocab()


def test_warns_when_the_cache_was_trained_differently(
    small_tokenizer, tokenizer_cache: Path, tokenizer_settings: dict, caplog
) -> None:
    settings = {**tokenizer_settings, "max_files": tokenizer_settings["max_files"] + 1}
    with caplog.at_level("WARNING", logger="forge.data.tokenizer"):
        load_or_train_tokenizer(tokenizer_cache, **settings)
    assert "delete that directory to retrain" in caplog.text


def test_loads_with_auto_tokenizer_and_survives_save_pretrained(
    small_tokenizer, tokenizer_cache: Path, tokenizer_settings: dict, tmp_path: Path
) -> None:
    target = tokenizer_cache_path(tokenizer_cache, tokenizer_settings["vocab_size"])
    loaded = AutoTokenizer.from_pretrained(target)
    small_tokenizer.save_pretrained(tmp_path / "checkpoint")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "checkpoint")
    expected = small_tokenizer(SAMPLE)["input_ids"]
    for other in (loaded, reloaded):
        assert other(SAMPLE)["input_ids"] == expected
        assert other.eos_token_id == other.pad_token_id == small_tokenizer.eos_token_id


def test_trains_on_given_files_and_clears_leftovers(tmp_path: Path) -> None:
    source = tmp_path / "corpus.py"
    source.write_text("alpha beta gamma\n" * 200)
    stale = tmp_path / "cache" / ".tokenizer-bpe-300.tmp-killed"  # from a killed builder
    stale.mkdir(parents=True)
    tok = load_or_train_tokenizer(tmp_path / "cache", vocab_size=300, files=[source])
    assert not stale.exists()
    ids = tok("alpha beta gamma\n", add_special_tokens=False)["input_ids"]
    assert len(ids) <= 4 and tok.decode(ids) == "alpha beta gamma\n"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 100}, "vocab_size"),
        ({"min_frequency": 0}, "min_frequency"),
        ({"files": ["/no/such/file.py"]}, "files"),
        ({"max_files": -1}, "max_files"),
    ],
)
def test_bad_arguments_are_named(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_or_train_tokenizer(tmp_path, **kwargs)


_RACER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from forge.data import tokenizer as module

    cache, me, other, log = (Path(a) for a in sys.argv[1:5])
    real = module.train_bpe_tokenizer

    def slow_train(*args, **kwargs):
        with open(log, "a") as handle:
            handle.write("trained\\n")
        time.sleep(1.0)  # hold the lock long enough for the other process to arrive
        return real(*args, **kwargs)

    module.train_bpe_tokenizer = slow_train
    me.touch()
    while not other.exists():
        time.sleep(0.01)
    tok = module.load_or_train_tokenizer(cache, vocab_size=300, max_files=8)
    print(len(tok), tok("import os", add_special_tokens=False)["input_ids"])
    """
)


def _race(cache: Path, barrier, trained, results) -> None:
    barrier.wait()
    tok = load_or_train_tokenizer(cache, vocab_size=300, max_files=8)
    results.put((len(tok), tok("import os", add_special_tokens=False)["input_ids"]))


def test_two_processes_building_at_once_share_one_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    context = multiprocessing.get_context("fork")
    barrier, trained, results = context.Barrier(2), context.Value("i", 0), context.Queue()
    real = tokenizer_module.train_bpe_tokenizer

    def slow_train(*args, **kwargs):
        with trained.get_lock():
            trained.value += 1
        time.sleep(0.5)  # hold the lock long enough for the other process to arrive
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", slow_train)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    cache = tmp_path / "cache"
    procs = [
        context.Process(target=_race, args=(cache, barrier, trained, results)) for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    outputs = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert trained.value == 1
    assert outputs[0] == outputs[1] and outputs[0][0] == 300
    assert sorted(p.name for p in cache.iterdir()) == [
        "tokenizer-bpe-300",
        "tokenizer-bpe-300.lock",
    ]
    assert (
        AutoTokenizer.from_pretrained(cache / "tokenizer-bpe-300")("import os")["input_ids"]
        == outputs[0][1]
    )


@pytest.mark.slow
def test_two_interpreters_building_at_once_share_one_tokenizer(tmp_path: Path) -> None:
    cache, log = tmp_path / "cache", tmp_path / "trained.log"
    ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(cache), str(ready[i]), str(ready[1 - i]), str(log)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    assert log.read_text().splitlines() == ["trained"]
    assert outputs[0][0] == outputs[1][0] and outputs[0][0].startswith("300 ")
    assert sorted(p.name for p in cache.iterdir()) == [
        "tokenizer-bpe-300",
        "tokenizer-bpe-300.lock",
    ]
    AutoTokenizer.from_pretrained(cache / "tokenizer-bpe-300")
