"""Committing a chunk: admit it, run it through the stage, commit it in parts that fit.

A commit stores the chunk's outputs, its state changes and the seen-marks in one atomic step
(:mod:`onceflow.dedup.commit`). Records admission turns away (late, ahead, ID conflicts) and
records whose outputs pass a commit's bytes become dead letters; a commit that conflicts with
another task's, or that GC's raised floor refuses, is redone without the records concerned.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace

from onceflow.dedup.admission import Admission
from onceflow.dedup.commit import FloorRaised
from onceflow.kernel import ids
from onceflow.kernel.limits import outputs_bytes
from onceflow.kernel.records import DeadLetter, InRow, Output, StateWrite
from onceflow.runtime.faults import CrashPoint
from onceflow.runtime.guard import Guard
from onceflow.runtime.ops.body import StageBody
from onceflow.runtime.ops.record_text import Origins, StageFailure, ahead_reason, portable
from onceflow.runtime.spec import StageSpec
from onceflow.runtime.task.times import timed

# Event times below this many ms (September 2001) are taken to be seconds by mistake.
SECONDS_NOT_MS = 1_000_000_000_000


class ChunkCommits:
    """Admits, runs and commits a task's chunks (see the module docstring).

    ``origins`` is shared with the task's input (where each source record was read); the
    content fingerprints of the chunk under way tell ID conflicts apart.
    """

    def __init__(
        self,
        spec: StageSpec,
        guard: Guard,
        body: StageBody,
        origins: Origins,
        count: Callable[[str, int], None],
        crash: Callable[[CrashPoint], None],
    ) -> None:
        self.spec = spec
        self.guard = guard
        self.body = body
        self.origins = origins
        self.count = count
        self.crash = crash
        # the chunk's rows and their fingerprints (indexed only when an ID conflict asks)
        self.chunk: tuple[list[InRow], Sequence[int]] = ([], ())

    def attempt(
        self,
        chunk_no: int,
        rows: list[InRow],
        carried: list[Output],
        lanes: Mapping[str, int],
        positional: Sequence[bool] = (),
        fingerprints: Sequence[int] = (),
    ) -> tuple[Admission, list[Output], int]:
        """Admit a chunk, then run and commit it (in parts when its writes pass the budget).

        Dead letters of late, ahead and ID-conflicting records (and ``carried`` ones) are
        taken before the loop: they leave with the first part's commit, whatever has to be
        redone. Returns the admission, the outputs committed and the next chunk's number.
        """
        self.chunk = (rows, fingerprints)
        with timed("redis admit"):
            admission = self.guard.admit(rows, positional, fingerprints)
        for inbound, _rid, ts, kb, elem in admission.replayed:
            if kb is not None:
                self.body.touch(inbound, kb, elem[0], ts)
        for row in admission.late:
            self._refuse(row, late_reason(row[2]), "late")
        for row in admission.ahead:
            self._refuse(row, ahead_reason(row[2], self.guard.limit_ms), "ahead")
        for row in admission.conflicts:
            self._refuse_conflict(row)
        before = carried + self.body.take()
        todo = admission.fresh
        outputs: list[Output] = []
        while True:
            committed, todo = self._commit_part(chunk_no, todo, before, lanes, admission.unmarked)
            outputs += committed
            chunk_no += 1
            if not todo:
                return admission, outputs, chunk_no
            before = []

    def _commit_part(
        self,
        chunk_no: int,
        fresh: list[InRow],
        before: list[Output],
        lanes: Mapping[str, int],
        unmarked: Collection[bytes],
    ) -> tuple[list[Output], list[InRow]]:
        """Run and commit the first rows of ``fresh`` whose writes fit the chunk's bytes.

        Returns the outputs committed and the rows left for the next part (the lanes go with
        the last part). A commit that conflicts (records another task committed meanwhile) is
        redone without them. A record whose outputs alone pass the budget becomes a dead
        letter (``too_large``) and is committed as an input with the letter as its only
        output, so that a retry replays it rather than run it again. A commit refused because
        GC raised its floor meanwhile (:class:`FloorRaised`) is redone without the records
        the floor makes late, which become dead letters as admission's late ones do.
        """
        counts = self.body.counts()
        rest: list[InRow] = []
        refused: dict[bytes, DeadLetter] = {}
        while True:
            with timed("stage code"):
                self.body.run([r for r in fresh if r[1] not in refused] if refused else fresh)
            for letter in refused.values():
                self.body.dead(letter)
            updates = self.body.state_updates(self.guard.read_state)  # may fire late panes
            made = self.body.take()
            deltas = self.body.partial_deltas() if self.guard.mode.ids else []
            cut = self._cut_at(fresh, before, made + deltas, updates, refused)
            if cut is not None:  # too much for one commit: fewer rows, or the one refused
                self.body.reset_chunk()
                self.body.restore_counts(counts)
                if cut == 0:
                    refused[fresh[0][1]] = self._too_large_letter(fresh[0], made + deltas)
                else:
                    fresh, rest = fresh[:cut], fresh[cut:] + rest
                continue
            outputs = before + made
            self.crash(CrashPoint.BEFORE_COMMIT)
            try:
                with timed("redis commit"):
                    conflicts = self.guard.commit(
                        chunk_no, fresh, outputs + deltas, updates, {} if rest else lanes, unmarked
                    )
            except FloorRaised as raised:
                self.body.reset_chunk()
                self.body.restore_counts(counts)
                fresh, letters = self._late_after_gc(raised.floor_ms, fresh, unmarked)
                before = before + letters
                counts = self.body.counts()
                continue
            if not conflicts:
                break
            other = self.guard.conflicting_content()  # another record's ID, not a copy
            self.count("commit_conflicts", len(conflicts))
            self.count("duplicates_dropped", len(conflicts) - len(other))
            self.body.reset_chunk()
            self.body.restore_counts(counts)  # the redo counts its dead letters anew
            if other:
                before = before + self._conflict_letters([r for r in fresh if r[1] in other])
                counts = self.body.counts()
            fresh = [r for r in fresh if r[1] not in conflicts]
            refused = {rid: letter for rid, letter in refused.items() if rid not in conflicts}
        self.body.chunk_committed()
        self.crash(CrashPoint.AFTER_COMMIT)
        return outputs, rest

    def _conflict_letters(self, rows: list[InRow]) -> list[Output]:
        """Dead letters of rows another task committed an ID of, with other content."""
        for row in rows:
            self._refuse_conflict(row)
        self.count("id_conflicts", len(rows))
        return self.body.take()

    def _late_after_gc(
        self, floor_ms: int, fresh: list[InRow], unmarked: Collection[bytes]
    ) -> tuple[list[InRow], list[Output]]:
        """GC deleted seen-IDs below ``floor_ms`` while the batch ran: those records are late.

        Their copies' seen-marks may be gone, so they cannot be told from copies (rows without
        seen-marks, ``unmarked`` position IDs, need none). Returns the rows left and the late
        ones' dead letters.
        """
        self.guard.raise_floor(floor_ms)
        late = [r for r in fresh if r[1] not in unmarked and self.guard.is_late(r[2])]
        for row in late:
            self._refuse(row, late_reason(row[2]), "late")
        self.count("gc_floor_redos", 1)
        self.count("late", len(late))
        self.guard.note("late", len(late))
        gone = {r[1] for r in late}
        return [r for r in fresh if r[1] not in gone], self.body.take()

    def _cut_at(
        self,
        fresh: list[InRow],
        before: list[Output],
        written: list[Output],
        updates: Mapping[str, StateWrite],
        refused: Mapping[bytes, DeadLetter],
    ) -> int | None:
        """How many rows of ``fresh`` to keep so that the commit fits (None: all of them).

        0 means the first row alone writes more than a commit may carry, a record too large to
        process. Otherwise the estimate keeps the share of rows the budget has room for; if
        that is still too much the next run cuts again.
        """
        budget = self.guard.chunk_bytes
        if budget <= 0 or not fresh:
            return None
        out = outputs_bytes(written)
        state = _state_bytes(updates)
        carried = outputs_bytes(before) if before else 0
        if out + state + carried <= budget:
            return None
        if len(fresh) > 1:
            room = max(budget - carried, 0) / (out + state)
            return min(len(fresh) - 1, max(1, int(len(fresh) * room)))
        if out > budget and fresh[0][1] not in refused:
            return 0
        return None  # one row, within the budget but for carried letters or state: commit it

    def _too_large_letter(self, row: InRow, written: list[Output]) -> DeadLetter:
        """The dead letter of a record whose outputs together pass the chunk's bytes."""
        reason = (
            f"its outputs take {outputs_bytes(written)} bytes together, more than one commit "
            f"may carry ({self.guard.chunk_bytes} bytes, DedupConfig.chunk_bytes): it is not "
            "processed; raise chunk_bytes, or make the function's outputs smaller"
        )
        if self.spec.on_error == "fail":
            raise StageFailure(reason)
        self.count("too_large", 1)
        return self._letter(row, reason, "too_large")

    def _refuse(self, row: InRow, reason: str, code: str) -> None:
        """A record admission turned away becomes a dead letter (it is counted, not lost)."""
        self.body.dead(self._letter(row, reason, code))

    def _refuse_conflict(self, row: InRow) -> None:
        """A record under an ID another record with other content has: a dead letter.

        Its letter's ID derives from the ID and the content, so that several such records
        (one ID header copied onto each) make several letters, and copies of one make one.
        """
        rows, fingerprints = self.chunk
        fp = (
            next((p for r, p in zip(rows, fingerprints, strict=True) if r is row), 0)
            if fingerprints
            else 0
        )
        letter = self._letter(row, id_conflict_reason(row[1]), "id_conflict")
        self.body.dead(replace(letter, id=ids.from_user_key(row[1] + fp.to_bytes(4, "big"))))

    def _letter(self, row: InRow, reason: str, code: str) -> DeadLetter:
        """A dead letter for an input row (where it was read, its value as JSON if it can)."""
        _inbound, rid, ts, _kb, elem = row
        origin = self.origins.get(rid) or (rid.hex() if rid else self.spec.name)
        return DeadLetter(rid, ts, self.spec.name, reason, origin, None, portable(elem), code)


def id_conflict_reason(rid: bytes) -> str:
    """Why a record under an ID another record with other content has is not processed."""
    return (
        f"record ID {rid.hex()} was already used by a record with other content (key and "
        "value bytes): no copy, another record. An app between two pipelines may have copied "
        "one onceflow-id header onto several records, or the source's id function names an "
        "entity (an order) rather than an event; give each event its own ID (KafkaSource(id="
        "...) wins over the header)"
    )


def late_reason(ts: int) -> str:
    """Why a record older than the dedup horizon is not processed."""
    hint = ""
    if 0 < ts < SECONDS_NOT_MS and ts * 1000 > SECONDS_NOT_MS:
        hint = " (it looks like seconds, not milliseconds: fix the timestamp function)"
    return (
        f"event time {ts} is older than the dedup horizon: a copy of this record could no "
        f"longer be recognised, so it is not processed{hint}"
    )


def _state_bytes(updates: Mapping[str, StateWrite]) -> int:
    """What a chunk's keyed-state writes weigh in its commit (keys, values and timers)."""
    total = 0
    for write in updates.values():
        values = write.values
        total += sum(map(len, values)) + sum(map(len, filter(None, values.values())))
        for timers in write.timers.values():
            total += sum(map(len, timers)) + 8 * len(timers)
    return total
