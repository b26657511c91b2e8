"""A Hugging Face model folder as ``save_pretrained`` writes it: its ``config.json``, its weights
(``model.safetensors``, or shards listed by ``model.safetensors.index.json``, or a torch
``pytorch_model.bin``) read one tensor at a time with plain file reads, and the files a run
keeps beside them (tokenizer, generation settings)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tk.core.errors import TkError

KEY = "model.pretrained_from"
# the files a language model's run keeps from its source folder (what tk generate / export need)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
SINGLE, INDEX, TORCH = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"
_CHUNK = 16 << 20  # bytes read at a time when a tensor changes dtype on the way in


def is_hf_folder(path: str | Path) -> bool:
    """A folder holding a ``config.json`` and no tk ``config.yaml`` (a tk run dir)."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / "config.json").is_file() and not (p / "config.yaml").is_file()


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's ``config.json``.

    Raises:
        TkError: missing or unreadable, named.
    """
    path = folder / "config.json"
    if folder.is_file():
        raise TkError(f"{KEY}: {folder} is a file; give the folder transformers' save_pretrained wrote (config.json, "
                      f"model.safetensors or its shards, the tokenizer files) or a hub id")
    if not path.is_file():
        raise TkError(f"{KEY}: {folder} has no config.json; give a folder written by transformers' save_pretrained "
                      f"(config.json, model.safetensors or its shards, tokenizer.json) or a hub id")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TkError(f"{KEY}: cannot read {path}: {str(e).splitlines()[0]}") from e
    if not isinstance(config, dict):
        raise TkError(f"{KEY}: {path} is not a JSON object")
    return config


def read_json(folder: Path, name: str) -> dict[str, Any]:
    """An optional JSON file of the folder (``{}`` where it is absent).

    Raises:
        TkError: present but unreadable.
    """
    path = folder / name
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TkError(f"{KEY}: cannot read {path}: {str(e).splitlines()[0]}") from e


class WeightFiles:
    """The tensors of a folder by name, each read when asked for, with plain file reads straight
    into the tensor that keeps it (:meth:`read_into`): no memory map whose pages would count
    twice, no second copy, and a sharded checkpoint is never held whole. Opening reads every
    file's header, so a truncated file or a missing shard fails before anything heavy.

    Raises (constructor):
        TkError: no weights file, an index naming a missing shard, a truncated or damaged file.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._where: dict[str, Path] = {}
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}  # dtype, shape, start, end
        self._torch: dict[str, torch.Tensor] | None = None
        if (folder / SINGLE).is_file():
            self._add(folder / SINGLE)
        elif (folder / INDEX).is_file():
            self._add_index(folder / INDEX)
        elif (folder / TORCH).is_file():
            self._torch = _read_torch(folder / TORCH)
        else:
            raise TkError(f"{KEY}: {folder} has no weights ({SINGLE}, {INDEX} or {TORCH})")

    def _add(self, path: Path) -> None:
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 2 <= n <= size - 8:
                    raise ValueError(f"a header of {n} bytes in a file of {size}")
                header = json.loads(f.read(n))
            base, end = 8 + n, 0
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                start, stop = info["data_offsets"]
                self._entries[name] = (_ST_DTYPES[info["dtype"]], tuple(info["shape"]), base + start, base + stop)
                self._where[name] = path
                end = max(end, base + stop)
        except (OSError, ValueError, KeyError, TypeError) as e:
            detail = (str(e).splitlines() or [type(e).__name__])[0][:160]
            raise TkError(f"{KEY}: cannot read {path}: the file is truncated or damaged ({detail}); download or "
                          f"save it again") from e
        # the header names each tensor's byte range: a file cut short is caught here, not mid-load
        if end > size:
            raise TkError(f"{KEY}: {path} is truncated ({size} bytes, its header describes {end}); download or "
                          f"save it again")

    def _add_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TkError(f"{KEY}: cannot read {index}: not a safetensors index ({e})") from e
        for shard in sorted(set(weight_map.values())):
            path = self.folder / shard
            if not path.is_file():
                first = next(n for n, s in weight_map.items() if s == shard)
                raise TkError(f"{KEY}: {index.name} names the shard {shard} (holding {first!r}, ...) but {path} "
                              f"does not exist; download the missing shard")
            self._add(path)
        missing = [n for n, s in weight_map.items() if n not in self._where]
        if missing:
            raise TkError(f"{KEY}: {index.name} places {missing[0]!r} in {weight_map[missing[0]]}, which does not "
                          f"hold it; the folder's shards and index disagree")

    def names(self) -> list[str]:
        return list(self._torch) if self._torch is not None else list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in (self._torch if self._torch is not None else self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._torch[name].shape) if self._torch is not None else self._entries[name][1]

    def file_dtype(self, name: str) -> torch.dtype:
        return self._torch[name].dtype if self._torch is not None else self._entries[name][0]

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``, in the file's dtype (a fresh CPU tensor)."""
        if self._torch is not None:
            return self._torch[name]
        out = torch.empty(self.shape(name), dtype=self.file_dtype(name))
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous, the tensor's shape; any dtype) with the tensor ``name``: read
        in place when the dtypes agree, else through a buffer of the file's dtype of at most
        ``_CHUNK`` bytes (a bf16 file upcast to float32 never holds a whole tensor twice)."""
        if self._torch is not None:
            out.copy_(self._torch[name])
            return
        kind, shape, start, end = self._entries[name]
        if tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"read_into({name!r}): got a {tuple(out.shape)} tensor for a {shape} one")
        flat = out.view(-1)
        step = max(1, _CHUNK // kind.itemsize) if kind != out.dtype else max(flat.numel(), 1)
        with open(self._where[name], "rb") as f:
            f.seek(start)
            for i in range(0, flat.numel(), step):
                part = flat[i: i + step]
                buffer = part if kind == out.dtype else torch.empty(part.numel(), dtype=kind)
                raw = buffer.view(torch.uint8)
                if f.readinto(memoryview(raw.numpy())) != raw.numel():
                    raise TkError(f"{KEY}: {self._where[name]} ends inside tensor {name!r}; the file is truncated")
                if buffer is not part:
                    part.copy_(buffer)

    def dtype(self) -> torch.dtype:
        """The dtype of the first floating-point tensor (what ``model.dtype: auto`` keeps)."""
        for name in self.names():
            dtype = self.file_dtype(name)
            if dtype.is_floating_point:
                return dtype
        return torch.float32

    def nbytes(self) -> int:
        """Bytes on disk of the weights files."""
        if self._torch is not None:
            return (self.folder / TORCH).stat().st_size
        return sum(p.stat().st_size for p in set(self._where.values()))


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _read_torch(path: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises several kinds for a damaged file
        detail = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise TkError(f"{KEY}: cannot read {path}: the file is truncated or damaged ({detail})") from e
