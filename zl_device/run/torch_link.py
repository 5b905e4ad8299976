"""The data-plane link of `--runtime torch`: stage k's hidden states to stage k+1 over torch.distributed p2p.

One DATA entry per micro-batch, as three point-to-point messages (the runner's
DATA frame, docs/design.md §4.6, without MAC or input log):

    header  (2,) int64         [micro-batch id, L]   L = the micro-batch's length after cutting the padding
    ints    (2, B, L) int64    attention mask, labels
    hidden  (B, L, D) float32  the stage's output hidden state

`send` posts the three with `isend` and returns at once, so the sender's phase 2
(local loss, backward) overlaps the transfer, as the runner's early forwarding
does; at most `depth` entries are un-received (gloo completes a send only once
the receiver has posted its receive), beyond that `send` waits: back-pressure.
The receiver posts the next header's `irecv` as soon as it has taken an entry.

Every wait is bounded by `timeout_s`: a neighbour that died or hangs makes this
rank fail with a `ZLError` that names the stage, the micro-batch and the fix,
instead of waiting forever (a dead neighbour usually shows sooner, as a closed
connection).
"""

from __future__ import annotations

import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from zl.errors import ZLError

HEADER_TAG, INTS_TAG, HIDDEN_TAG = 0, 1, 2


class StageLink:
    """Stage `rank`'s ends of the links to `rank - 1` (receive) and `rank + 1` (send)."""

    def __init__(self, rank: int, world: int, batch: int, hidden: int, device: torch.device, depth: int,
                 timeout_s: float):
        self.rank, self.world = rank, world
        self.batch, self.hidden, self.device = batch, hidden, device
        self.depth = max(1, depth)
        self.timeout = timedelta(seconds=timeout_s)
        self._pending: deque[tuple[int, list, tuple]] = deque()  # (micro-batch, works, tensors kept alive)
        self._header: tuple[torch.Tensor, object] | None = None  # the posted receive of the next header
        self.sent = 0
        self.received = 0
        self.max_in_flight = 0

    # --- sending (every stage but the last) ---------------------------------------------------------------

    def send(self, mb: int, hidden: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> float:
        """Post micro-batch `mb`'s entry to stage rank+1; returns the ms spent waiting for a free slot.

        Args:
            hidden: (B, L, D) float32; mask, labels: (B, L) int64. Kept alive until the receiver has them.
        """
        start = time.perf_counter()
        while len(self._pending) >= self.depth:
            self._wait_oldest()
        blocked_ms = (time.perf_counter() - start) * 1e3
        header = torch.tensor([mb, hidden.shape[1]], dtype=torch.int64, device=self.device)
        ints = torch.stack([mask, labels]).contiguous()  # (2, B, L)
        hidden = hidden.contiguous()
        dst = self.rank + 1
        works = [dist.isend(header, dst, tag=HEADER_TAG), dist.isend(ints, dst, tag=INTS_TAG),
                 dist.isend(hidden, dst, tag=HIDDEN_TAG)]
        self._pending.append((mb, works, (header, ints, hidden)))
        self.sent += 1
        self.max_in_flight = max(self.max_in_flight, len(self._pending))
        return blocked_ms

    def flush(self) -> float:
        """Wait until stage rank+1 has received every entry sent so far (the runner's flush before a commit);
        returns the ms it took."""
        start = time.perf_counter()
        while self._pending:
            self._wait_oldest()
        return (time.perf_counter() - start) * 1e3

    def _wait_oldest(self) -> None:
        mb, works, _ = self._pending[0]
        for work in works:
            self._wait(work, f"stage {self.rank + 1} to receive micro-batch {mb}")
        self._pending.popleft()

    # --- receiving (every stage but the first) -------------------------------------------------------------

    def post_receive(self) -> None:
        """Post the receive of the next entry's header (no-op when one is posted)."""
        if self._header is None:
            header = torch.empty(2, dtype=torch.int64, device=self.device)
            self._header = (header, dist.irecv(header, self.rank - 1, tag=HEADER_TAG))

    def receive(self, mb: int, more: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Micro-batch `mb`'s entry from stage rank-1: (hidden (B, L, D) f32, mask (B, L), labels (B, L)).

        Args:
            more: another entry follows; its header's receive is posted before returning.

        Raises:
            ZLError: the wait timed out or the neighbour went away, or an entry of another micro-batch came.
        """
        self.post_receive()
        header, work = self._header
        what = f"micro-batch {mb} from stage {self.rank - 1}"
        self._wait(work, what)
        self._header = None
        got, length = (int(v) for v in header.tolist())
        if got != mb:
            raise ZLError(f"stage {self.rank}: received micro-batch {got} from stage {self.rank - 1}, expected {mb}; "
                          "the stages disagree on the run's plan (--samples, --window, --micro-batch).")
        ints = torch.empty(2, self.batch, length, dtype=torch.int64, device=self.device)
        hidden = torch.empty(self.batch, length, self.hidden, dtype=torch.float32, device=self.device)
        works = [dist.irecv(ints, self.rank - 1, tag=INTS_TAG), dist.irecv(hidden, self.rank - 1, tag=HIDDEN_TAG)]
        for w in works:
            self._wait(w, what)
        self.received += 1
        if more:
            self.post_receive()
        return hidden, ints[0], ints[1]

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:  # gloo: "Timed out waiting ...", "Connection closed by peer", ...
            seconds = self.timeout.total_seconds()
            raise ZLError(f"stage {self.rank}: waiting for {what} failed after at most {seconds:g} s ({e}); "
                          "did that stage fail (see its error above)? If it is only slow, raise --link-timeout.") from e

    def stats(self) -> dict:
        return {"sent": self.sent, "received": self.received, "max_in_flight_seen": self.max_in_flight,
                "in_flight_depth": self.depth}
