"""Checkpoints through torch.distributed.checkpoint (DCP), committed atomically.

Layout: <out_dir>/checkpoints/step_00000100/ holding DCP shards (model and
optimizer keyed by parameter name, so a checkpoint loads under another plan or
world size), trainer.json (step, data position, config, plan) and one
rng_rank<r>.safetensors per rank. Every rank writes into `step_N.tmp`; rank 0
renames it once all ranks are done, so a half-written checkpoint never has a
name that `latest()` picks up. `save_async` does the same with the write in
the background.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from safetensors.torch import load_file, save_file

from snugfit.errors import SnugfitError
from snugfit.runtime.dist import DistEnv, cached_group

log = logging.getLogger("snugfit")
STEP_DIR = re.compile(r"^step_(\d{8})$")


# DCP warns at every single-process save and load that it is single-process; that is intended. Filtered for the
# whole process, not around each call: an async save's background writer warns after the call has returned
# (the README's default run printed it at each periodic checkpoint)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.accelerator.is_available():
        state["accelerator"] = torch.get_device_module(torch.accelerator.current_accelerator()).get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "accelerator" in state and torch.accelerator.is_available():
        torch.get_device_module(torch.accelerator.current_accelerator()).set_rng_state(state["accelerator"])


class Checkpoints:
    def __init__(self, root: Path, keep: int, env: DistEnv):
        self.root, self.keep, self.env = root, keep, env
        self._in_flight: threading.Thread | None = None  # the background commit of an async save
        self._error: SnugfitError | None = None  # its failure, raised by the next wait()

    def committed(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))

    def latest(self) -> Path | None:
        found = self.committed()
        return found[-1] if found else None

    def save(self, step: int, engine_state: dict, trainer_state: dict) -> Path:
        """Write and commit the checkpoint of `step` before returning (after any save still in flight)."""
        self.wait()
        final, tmp = self._prepare(step)
        if tmp is None:
            return final
        try:
            self._write_small(tmp, step, trainer_state)
            dcp.save(engine_state, checkpoint_id=str(tmp), no_dist=self.env.world_size == 1)
        except (OSError, CheckpointException) as e:
            raise self._failed(final, tmp, e) from e
        _barrier()
        self._commit(tmp, final)
        _barrier()
        return final

    def save_async(self, step: int, engine_state: dict, trainer_state: dict) -> Path:
        """Stage the checkpoint of `step` in host memory and write it in the background (DCP's async_save):
        training waits only for the copy. A background thread commits it (the rename) once every rank's write
        has finished; until then the previous checkpoint stays the newest, so a crash in between loses nothing
        committed. A failed write is raised by the next `save`, `save_async` or `wait`."""
        self.wait()
        final, tmp = self._prepare(step)
        if tmp is None:
            return final
        multi = self.env.world_size > 1
        # The background write and commit talk on their own gloo group: the training's collectives on the
        # default group go on meanwhile, and two threads must never share a group's order of operations.
        # Its timeout is the run's: DCP's writer thread is joined at exit, so a peer gone mid-commit would otherwise
        # hold this rank (and torchrun) for gloo's default 30 min.
        timeout = timedelta(seconds=self.env.timeout_s)
        group = (cached_group(("checkpoint", self.env.timeout_s), lambda: dist.new_group(backend="gloo", timeout=timeout))
                 if multi else None)
        try:
            self._write_small(tmp, step, trainer_state)
            future = dcp.async_save(engine_state, checkpoint_id=str(tmp), process_group=group, no_dist=not multi)
        except (OSError, CheckpointException) as e:
            raise self._failed(final, tmp, e) from e
        self._in_flight = threading.Thread(target=self._commit_when_written, args=(future, group, final, tmp),
                                           name=f"commit {final.name}", daemon=True)
        self._in_flight.start()
        return final

    def wait(self) -> None:
        """Block until the save in flight, if any, is committed; raise its failure as a one-line error."""
        if self._in_flight is not None:
            self._in_flight.join()
            self._in_flight = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def settle(self, timeout_s: float) -> None:
        """On the way out of a failed run: give the save in flight up to timeout_s to commit (its write is usually
        done; its commit needs the other ranks, which may be gone). Its own failure is logged, not raised: the
        run's error is the one to report."""
        if self._in_flight is not None:
            self._in_flight.join(timeout_s)
            if self._in_flight.is_alive():
                log.warning("checkpoint %s was still being written; the newest committed one stays the newest",
                            self._in_flight.name.removeprefix("commit "))
            self._in_flight = None
        if self._error is not None:
            log.warning("%s", self._error)
            self._error = None

    def _prepare(self, step: int) -> tuple[Path, Path | None]:
        final = self.root / f"step_{step:08d}"
        if final.exists():  # already saved (e.g. the last step coincides with an interval): never overwrite
            return final, None
        tmp = final.with_name(final.name + ".tmp")
        if self.env.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # leftover of a crashed save: never committed, safe to drop
            tmp.mkdir()
        _barrier()
        return final, tmp

    def _write_small(self, tmp: Path, step: int, trainer_state: dict) -> None:
        save_file(rng_state(), str(tmp / f"rng_rank{self.env.rank}.safetensors"))
        if self.env.is_main:
            _write_json(tmp / "trainer.json", {"step": step, **trainer_state})

    def _failed(self, final: Path, tmp: Path, e: BaseException) -> SnugfitError:
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # never committed; frees what it took
        return SnugfitError(
            f"writing checkpoint {final.name} failed ({root_cause(e)}); free disk space or change train.out_dir — "
            "earlier checkpoints are untouched"
        )

    def _commit(self, tmp: Path, final: Path) -> None:
        if self.env.is_main:
            os.replace(tmp, final)
            _fsync_dir(self.root)
            for old in self.committed()[: -self.keep]:
                shutil.rmtree(old)

    def _commit_when_written(self, future, group, final: Path, tmp: Path) -> None:
        """In the background: every rank says whether its write succeeded; rank 0 renames only if all did."""
        failure: BaseException | None = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - raised by wait(); DCP's is a BaseException
            failure = e
        try:
            failed = torch.tensor([failure is not None], dtype=torch.int32)
            if group is not None:
                dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
            if failed.item():
                failure = failure or RuntimeError("another rank's write failed")
            else:
                self._commit(tmp, final)
            if group is not None:
                dist.barrier(group=group)  # committed on rank 0 before any rank's wait() returns
        except Exception as e:  # noqa: BLE001 - a peer gone mid-commit: not committed
            failure = failure or e
        if failure is not None:
            self._error = self._failed(final, tmp, failure)
            self._error.__cause__ = failure

    def load(self, path: Path, engine_state: dict, model_identity: dict) -> dict:
        """Fill engine_state in place from path; return the trainer state saved with it."""
        meta = path / "trainer.json"
        if not meta.is_file():
            raise SnugfitError(f"{path} is not a snugfit checkpoint (no trainer.json); pass a step_* folder")
        try:
            trainer_state = json.loads(meta.read_text())
            if trainer_state.get("model") != model_identity:
                raise SnugfitError(
                    f"checkpoint {path} is of another model (its [model] differs); resume with the same [model] settings"
                )
            dcp.load(engine_state, checkpoint_id=str(path), no_dist=self.env.world_size == 1)
        except (json.JSONDecodeError, RuntimeError, ValueError, KeyError, OSError, CheckpointException) as e:
            raise SnugfitError(
                f"checkpoint {path} cannot be loaded ({root_cause(e)}); it is corrupt or from another model — "
                "resume from another checkpoint or start a new out_dir"
            ) from e
        rng = path / f"rng_rank{self.env.rank}.safetensors"
        if rng.is_file():  # absent when resuming at a larger world size: those ranks start fresh RNGs
            set_rng_state(load_file(str(rng)))
        return trainer_state


def root_cause(e: BaseException) -> str:
    """DCP wraps each rank's failure; name the first underlying one."""
    if isinstance(e, CheckpointException):
        rank, failure = next(iter(e.failures.items()))
        inner = getattr(failure, "exception", failure)
        return f"rank {rank}: {_first_line(getattr(inner, 'strerror', None) or inner)}"
    return _first_line(getattr(e, "strerror", None) or e)


def _first_line(e: object) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

