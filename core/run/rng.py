"""RNG states of every generator a run draws from (python, numpy, torch CPU and CUDA), as
tensors and plain Python so that checkpoints load with ``weights_only=True``."""

from __future__ import annotations

import contextlib
import random
import warnings
from typing import Any, Iterator, Mapping

import torch

__all__ = ["capture_rng_state", "restore_rng_state", "preserved_rng", "gather_rng_states"]


def capture_rng_state() -> dict[str, Any]:
    """States of python ``random``, numpy's global RNG, torch CPU and every CUDA device,
    as tensors and plain Python (safe for ``weights_only`` loading)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    except ImportError:  # pragma: no cover - numpy is a dependency, but keep RNG capture usable
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` returned (parts absent there are skipped)."""
    if "python" in state:
        py = state["python"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        keys = np.asarray(n["keys"].cpu().numpy(), dtype=np.uint32)
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = list(state["cuda"])
        if len(saved) != torch.cuda.device_count():
            warnings.warn(
                f"checkpoint has CUDA RNG states for {len(saved)} devices, {torch.cuda.device_count()} visible; "
                "restoring the first ones (runs are not bit-reproducible)", stacklevel=2,
            )
        for i, s in enumerate(saved[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run the block, then put every RNG (python, numpy, torch, CUDA) back as it was."""
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)


def gather_rng_states(world_size: int) -> list[dict[str, Any]]:
    """Every process's RNG states, rank order (a collective when ``world_size > 1``)."""
    state = capture_rng_state()
    if world_size == 1:
        return [state]
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, state)
    return gathered
