"""A burst of `generate` calls served in one RPC, results streamed back in groups: what a rollout server and a PD
router answer `generate_many` with (the rollout client sends each server a loop tick's calls at once)."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from rollout_adapters.base import TokenOutput


async def serve_many(
    generate: Callable[..., Awaitable[TokenOutput]], calls: list[tuple[str, list[int], dict[str, Any]]]
) -> AsyncIterator[list[tuple[int, TokenOutput | BaseException]]]:
    """Run `generate(*call)` for every call concurrently and yield [(index, output or error), ...] groups: the
    calls that finished in the same event-loop tick travel together (a burst of equal-length requests finishes in
    one engine step, so it comes back in one message). Each Ray call or streamed item costs the caller and this
    process CPU that a small host's engine would otherwise use (2 cores: 32 calls 22 ms, one call streaming its
    results in a few groups 2-4 ms). One call's error is its own result; if the caller goes away the rest are
    cancelled (the adapter aborts them in the engine)."""
    tasks = {asyncio.ensure_future(generate(*call)): index for index, call in enumerate(calls)}
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            yield [(tasks[task], _outcome(task)) for task in done]
    finally:
        for task in pending:
            task.cancel()


def _outcome(task: asyncio.Task) -> TokenOutput | BaseException:
    if task.cancelled():
        return RuntimeError("the call was cancelled in the rollout server")
    error = task.exception()
    if error is None:
        return task.result()
    try:  # the error travels as a result: one that cannot be pickled must not fail the whole group
        pickle.dumps(error)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
