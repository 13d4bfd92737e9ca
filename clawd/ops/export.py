"""`clawctl export-model VERSION DIR`: a published version as a full Hugging Face model, for serving it where
LoRA serving is not available (docs/ARCHITECTURE.md §15).

In LoRA mode a version is an adapter directory: it is merged into the base model (`[model] path`) in float32
and written in the served dtype with the base's tokenizer files. A full fine-tune's version already is a
model directory: it is copied. Offline (no running clawd needed); torch is imported only here, so the rest
of clawctl stays instant. DIR must not exist; it is written atomically.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from clawd.config.schema import Config
from clawd.weights import VERSION_DIR, atomic_dir, is_adapter, is_published, model_dtype, numbered, version_dir


class ExportError(Exception):
    pass


def export_model(cfg: Config, version: int, dest: Path) -> Path:
    source = version_dir(cfg.state_dir, version)
    if not is_published(source):
        kept = ", ".join(f"v{v}" for v, _ in numbered(cfg.state_dir / "weights", VERSION_DIR)) or "none"
        raise ExportError(f"v{version} is not in {cfg.state_dir / 'weights'} (kept versions: {kept})")
    dest = Path(dest)
    if dest.exists():
        raise ExportError(f"{dest} already exists")
    if not is_adapter(source):
        return atomic_dir(dest, lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True))
    from clawd.trainer.worker.adapters import export_merged  # torch, transformers and peft: only for this command

    return export_merged(cfg.model_path, source, dest, model_dtype(cfg.model_path, cfg.model.dtype))
