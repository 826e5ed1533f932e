"""Opening the data directory: the checkpoint, the index files, then the log replayed.

Separate from the running engine because it runs once, before anything else may touch
the state, and must leave it exactly as the engine had it at its last durable record.
"""

from __future__ import annotations

from polymq.storage.engine import records as rec
from polymq.storage.engine.commit_log import HEADER_SIZE
from polymq.storage.engine.core import EngineCore
from polymq.storage.engine.ids import MessageIds, load_node_id
from polymq.storage.engine.queue_index import load_index_file
from polymq.storage.engine.snapshot import iter_json_lines, read_snapshot, remove_stale

__all__ = ["recover"]


def recover(core: EngineCore) -> int:
    """Rebuild the state from the checkpoint and the log after it, and open the log;
    returns how many records were replayed."""
    core.dir.mkdir(parents=True, exist_ok=True)
    core.index_dir.mkdir(exist_ok=True)
    core.ids = MessageIds(load_node_id(core.dir))
    remove_stale(core.dir, "*.tmp", keep="")  # half-written by a crash
    snapshot = read_snapshot(core.dir)
    position = 0
    if snapshot is not None:
        position = int(snapshot["position"])
        core.state.load_snapshot(
            snapshot,
            iter_json_lines(core.dir, snapshot["topics_file"]),
            iter_json_lines(core.dir, snapshot["cursors_file"]),
        )
    _load_index_files(core)
    core.log.open()
    for held_position, held_size in (snapshot or {}).get("held", []):
        _restore_held(core, int(held_position), int(held_size))
    replayed = 0
    for record_position, payload in core.log.recover(position):
        core.state.replay(record_position, HEADER_SIZE + len(payload), rec.decode_record(payload))
        replayed += 1
    _reconcile_indexes(core)
    core.state.staged_copies.clear()  # copies of compactions a crash cut short
    # Hand-outs of a pop with durable=False may be lost by a crash, their receipts
    # still held by clients: new hand-outs must never reuse their seqs. Starting
    # above the clock's milliseconds times 65,536 does that (a node would have to
    # hand out more than 65,536 messages per millisecond of its uptime to reach it).
    core.state.pop_seq = max(core.state.pop_seq, core.now() << 16)
    core.checkpoint_position = position
    return replayed


def _load_index_files(core: EngineCore) -> None:
    for path in core.index_dir.glob("*.idx"):
        try:
            tid_text, qid_text = path.stem.split("-")
            topic = core.state.topics_by_id.get(int(tid_text))
            qid = int(qid_text)
        except ValueError:
            topic = None
            qid = -1
        loaded = load_index_file(path) if topic is not None else None
        if topic is None or loaded is None or qid >= len(topic.queues):
            path.unlink(missing_ok=True)
            continue
        base, entries, intact = loaded
        queue = topic.queues[qid]
        queue.base = base
        queue.file_base = base if intact else None  # torn: rewrite at the checkpoint
        if not intact:
            core.state.dirty_queues.add((topic.id, qid))
        queue.entries = entries
        queue.next_offset = queue.persisted_end = queue.end
    for path in core.index_dir.glob("*.tmp"):
        path.unlink(missing_ok=True)


def _reconcile_indexes(core: EngineCore) -> None:
    """Cut index entries that point past the log end or before its start."""
    start, end = core.log.start, core.log.end
    for topic in core.state.topics.values():
        for queue in topic.queues:
            if queue.end > queue.base and queue.position(queue.end - 1) >= end:
                queue.truncate(queue.first_offset_where("position", end))
            if queue.end > queue.base and queue.position(queue.base) < start:
                queue.trim_to(queue.first_offset_where("position", start))
            queue.earliest = min(max(queue.earliest, queue.base), queue.end)
            queue.next_offset = queue.end


def _restore_held(core: EngineCore, position: int, size: int) -> None:
    record = rec.decode_record(core.log.read(position, size))
    if isinstance(record, rec.MessageRecord):
        core.state.replay(position, size, record)
