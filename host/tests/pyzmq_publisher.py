"""An independent vLLM-format KV-event publisher (pyzmq + msgpack), for the host's wire tests.

usage: pyzmq_publisher.py bind ENCODING PUB_PORT REPLAY_PORT
       pyzmq_publisher.py topic PUB_PORT TOPIC
       pyzmq_publisher.py collector ENDPOINT TOPIC
       pyzmq_publisher.py restart PUB_PORT
Prints one JSON line describing what it published, then exits.
"""
import json
import sys
import time

import msgpack
import zmq

BS = 16


def stored(hashes, parent, tokens, enc, medium="GPU"):
    if enc == "map":
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
                "block_size": BS, "lora_id": None, "medium": medium, "lora_name": None,
                "extra_keys": [None] * len(hashes), "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    return ["BlockStored", hashes, parent, tokens, BS, None, medium, None, [None] * len(hashes), 0, "full_attention", None]


def removed(hashes, enc):
    if enc == "map":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}
    return ["BlockRemoved", hashes, "GPU", 0]


def batch(events):
    return msgpack.packb([time.time(), events, 0], use_bin_type=True)


def frames(topic, seq, payload):
    return [topic, seq.to_bytes(8, "big"), payload]


def bind(enc, pub_port, replay_port):
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    topic = b"kv@127.0.0.1:1@tinyllama"
    time.sleep(0.8)  # let the host's SUB connect; PUB drops messages sent before that
    a = [2**64 - 5, 2**63 + 7]                    # uint64 hashes
    b = [-42]                                       # an int64 hash
    c = [bytes(31) + b"\x09"]                       # a 32-byte hash
    held = {5: batch([stored([77], None, list(range(500, 516)), enc)])}   # only via replay
    msgs = [
        (0, batch([stored(a, None, list(range(0, 32)), enc)])),
        (1, b"\x93\xcb\x00"),                        # truncated msgpack
        (2, batch([["Unknown", 1] if enc == "array" else {"type": "Unknown"},
                   stored(b, a[-1], list(range(32, 48)), enc)])),
        (3, b"\xdd\xff\xff\xff\xff"),                 # absurd array length
        (4, batch([stored(c, -42, list(range(48, 64)), enc)])),
        # seq 5 is skipped: the host must fetch it from the replay socket
        (6, batch([removed([2**63 + 7], enc)])),
    ]
    for seq, payload in msgs:
        pub.send_multipart(frames(topic, seq, payload))
        time.sleep(0.05)
    pub.send_multipart([topic, b"short"])          # wrong frame count
    replays = 0
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    deadline = time.time() + 2.0
    while time.time() < deadline:
        if poller.poll(100):
            ident, _, start = router.recv_multipart()
            start = int.from_bytes(start, "big")
            for seq in sorted(held):
                if seq >= start:
                    router.send_multipart([ident, b"", topic, seq.to_bytes(8, "big"), held[seq]])
            router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
            replays += 1
    print(json.dumps({"published": len(msgs), "replays_served": replays,
                      "events": known_events([p for _, p in msgs] + list(held.values()))}))


def known_events(payloads):
    """Events of a known type in the payloads that decode: what a subscriber should apply."""
    n = 0
    for p in payloads:
        try:
            _, events, _ = msgpack.unpackb(p, raw=False)
        except Exception:
            continue
        for e in events:
            kind = e.get("type") if isinstance(e, dict) else e[0]
            n += kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
    return n


def collector(endpoint, topic):
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(endpoint)  # vLLM connects when its endpoint names a host
    time.sleep(0.8)
    pub.send_multipart(frames(topic.encode(), 0, batch([stored([11, 12], None, list(range(0, 32)), "map")])))
    pub.send_multipart(frames(b"kv@10.9.9.9:1@tinyllama", 0, batch([stored([13], None, list(range(0, 16)), "map")])))
    time.sleep(0.3)
    print(json.dumps({"published": 2}))


def topic_run(pub_port, topic):
    """vLLM as shipped: a bound PUB whose topic is whatever the engine was given ("" by default)."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    time.sleep(0.8)
    msgs = [
        batch([stored([21, 22], None, list(range(0, 32)), "map")]),
        batch([stored([23], 22, list(range(32, 48)), "map", medium="NVME")]),
        batch([stored([24], 23, list(range(48, 64)), "map", medium="CPU")]),
    ]
    for seq, payload in enumerate(msgs):
        pub.send_multipart(frames(topic.encode(), seq, payload))
        time.sleep(0.05)
    time.sleep(0.3)
    print(json.dumps({"published": len(msgs), "events": known_events(msgs), "unknown_media": 1}))


def restart(pub_port):
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    topic = b"kv@127.0.0.1:1@tinyllama"
    time.sleep(0.8)
    pub.send_multipart(frames(topic, 0, batch([stored([1], None, list(range(0, 16)), "map")])))
    pub.send_multipart(frames(topic, 1, batch([stored([2], None, list(range(100, 116)), "map")])))
    time.sleep(0.1)
    # The engine restarts: its sequence starts again at 0 and its cache is empty.
    pub.send_multipart(frames(topic, 0, batch([stored([3], None, list(range(200, 216)), "map")])))
    time.sleep(0.3)
    print(json.dumps({"published": 3}))


if __name__ == "__main__":
    if sys.argv[1] == "restart":
        restart(int(sys.argv[2]))
    elif sys.argv[1] == "bind":
        bind(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "topic":
        topic_run(int(sys.argv[2]), sys.argv[3])
    else:
        collector(sys.argv[2], sys.argv[3])
