"""Two shims over Flower's simulation engine (flwr 1.42) for runs of a thousand virtual nodes.

`reproducible_node_ids(seed)`: node ids from a seeded generator instead of `secrets`. Samplers order
nodes by id; with random ids the same sampling seed draws other partitions in every run.
`indexed_polling()`: the engine's dispatcher asks the link state, every 0.1 s and for each node, for
one pending message, scanning every stored message: O(nodes x messages). At 1000 nodes and cohorts of
200 that loop holds the GIL and a whole core. The shim asks only for the nodes that have one pending.
Both patch flwr's internals for the duration of a `with` and restore them; Flower offers no option.
"""

from __future__ import annotations

import contextlib
import random
import threading


@contextlib.contextmanager
def reproducible_node_ids(seed: int = 0):
    """Node, run and task ids of in-memory link states created inside the `with` from `seed`."""
    from flwr.server.superlink.linkstate import in_memory_linkstate as mod

    rng, original = random.Random(seed), mod.generate_rand_int_from_bytes

    def seeded(num_bytes: int, exclude: set[int] | None = None) -> int:
        while (value := rng.getrandbits(8 * num_bytes)) in (exclude or ()):
            pass
        return value

    mod.generate_rand_int_from_bytes = seeded
    try:
        yield
    finally:
        mod.generate_rand_int_from_bytes = original


def _pending_nodes(state) -> set[int] | None:
    """Destination node ids of the undelivered instructions, or None when `state` is not the
    in-memory link state whose store this reads."""
    store, lock = getattr(state, "message_ins_store", None), getattr(state, "lock", None)
    if store is None or lock is None:
        return None
    with lock:
        return {m.metadata.dst_node_id for m in store.values() if m.metadata.delivered_at == ""}


@contextlib.contextmanager
def indexed_polling():
    """The simulation's message dispatcher (vce_api.add_messages_to_queue) polls only nodes with a
    pending instruction; the messages, their order per node and the 0.1 s period are unchanged."""
    from flwr.server.superlink.fleet.vce import vce_api as mod

    original = mod.add_messages_to_queue

    def add_messages_to_queue(state, queue, nodes_mapping, f_stop: threading.Event) -> None:
        while not f_stop.is_set():
            pending = _pending_nodes(state)
            for node_id in nodes_mapping.keys() if pending is None else pending & nodes_mapping.keys():
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
            f_stop.wait(0.1)

    mod.add_messages_to_queue = add_messages_to_queue
    try:
        yield
    finally:
        mod.add_messages_to_queue = original
