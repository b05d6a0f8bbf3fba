"""The demo pair, as package data: a small Qwen3 code model (`target/`) trained on the Python
standard library and its DFlash drafter (`draft/`), both written by `jobs/demo/train.sh`."""

from pathlib import Path

TARGET = Path(__file__).parent / "target"
DRAFT = Path(__file__).parent / "draft"
