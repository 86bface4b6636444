"""Checkpoint save time: forge's CheckpointWriter against `torch.save` of the same state and
against the disk's own write speed for the same bytes, in one run.

forge's save writes HF-compatible safetensors weights, `training_state.pt` (optimizer and
scheduler), a per-rank state file, fsyncs every file, hashes it (sha256) into
`manifest.json` and renames the directory into place. `torch.save` is timed twice: as users
usually call it (no fsync) and with an fsync, which is what makes a save durable.

    .venv/bin/python bench/checkpoint_speed.py [--hidden 512 --layers 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forge.checkpoint import CheckpointWriter, capture_rng_state

CHUNK = 1 << 20


def build_state(hidden: int, layers: int):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 8192, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # materialize Adam's moment buffers
    return model, optimizer


def time_forge(model, optimizer, root: Path, step: int) -> float:
    start = time.perf_counter()
    with CheckpointWriter(root, step) as writer:
        writer.save_model(model)
        writer.save_torch("training_state.pt", {"optimizer": optimizer.state_dict(), "step": step})
        writer.save_torch("rank_state_00000.pt", {"rng": capture_rng_state()})
        writer.set_meta(epoch=0.0)
    return time.perf_counter() - start


def time_torch_save(model, optimizer, path: Path, fsync: bool) -> float:
    start = time.perf_counter()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    with open(path, "wb") as handle:
        torch.save(state, handle)
        if fsync:
            handle.flush()
            os.fsync(handle.fileno())
    return time.perf_counter() - start


def time_disk(blobs: list[bytes], root: Path) -> float:
    """Write the checkpoint's own bytes (already in memory) to new files and fsync them."""
    start = time.perf_counter()
    for index, blob in enumerate(blobs):
        with open(root / f"raw-{index}.bin", "wb", buffering=0) as handle:
            view = memoryview(blob)
            for offset in range(0, len(view), CHUNK):  # 1 MiB writes, as `dd bs=1M` does
                handle.write(view[offset : offset + CHUNK])
            os.fsync(handle.fileno())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    model, optimizer = build_state(args.hidden, args.layers)
    params = sum(p.numel() for p in model.parameters())
    root = Path(tempfile.mkdtemp(prefix="forge-bench-", dir=args.dir))
    try:
        times = {
            "forge CheckpointWriter": [],
            "torch.save": [],
            "torch.save + fsync": [],
            "disk write + fsync": [],
        }
        nbytes = 0
        for step in range(1, args.repeat + 1):
            # every contender starts with no dirty pages, so none pays for another's writeback
            os.sync()
            times["forge CheckpointWriter"].append(time_forge(model, optimizer, root, step))
            checkpoint = root / f"checkpoint-{step:06d}"
            blobs = [f.read_bytes() for f in sorted(checkpoint.rglob("*")) if f.is_file()]
            nbytes = sum(len(b) for b in blobs)
            shutil.rmtree(checkpoint)
            os.sync()
            times["torch.save"].append(time_torch_save(model, optimizer, root / "t.pt", False))
            os.sync()
            times["torch.save + fsync"].append(
                time_torch_save(model, optimizer, root / "t.pt", True)
            )
            os.sync()
            times["disk write + fsync"].append(time_disk(blobs, root))
            for path in [root / "t.pt", *root.glob("raw-*.bin")]:
                path.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    medians = {name: statistics.median(values) for name, values in times.items()}
    forge_s = medians["forge CheckpointWriter"]
    print(f"model: {params / 1e6:.1f}M parameters; checkpoint: {nbytes / 2**20:.1f} MiB")
    print(f"{'save':26s} {'median s':>9s} {'MiB/s':>8s} {'forge / this':>13s}")
    for name, seconds in medians.items():
        print(
            f"{name:26s} {seconds:9.3f} {nbytes / 2**20 / seconds:8.0f} {forge_s / seconds:13.2f}"
        )


if __name__ == "__main__":
    main()
