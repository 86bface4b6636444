"""`forge resume` hashes the checkpoint it continues from once: the command resolves and
validates it, and the trainer it starts takes it as it is."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import forge.checkpoint.layout as layout
from forge.cli import main
from tests.plain_project import train_in_process, write_project


def test_forge_resume_hashes_each_file_of_its_checkpoint_once(tmp_path, monkeypatch):
    root = write_project(tmp_path / "plain")
    run_dir = train_in_process(root, "lm")
    checkpoint = run_dir / "checkpoints" / "checkpoint-000004"
    files = {p for p in checkpoint.iterdir() if p.name != "manifest.json"}

    hashed: Counter[Path] = Counter()
    original = layout.hash_file

    def counting(path: Path) -> str:
        hashed[Path(path)] += 1
        return original(path)

    monkeypatch.setattr(layout, "hash_file", counting)
    code = main(["resume", "-p", str(root), "--set", "trainer.args.max_steps=6"])
    assert code == 0
    assert (run_dir / "checkpoints" / "checkpoint-000006").is_dir()  # it trained on
    assert {path: hashed[path] for path in files} == dict.fromkeys(files, 1)
