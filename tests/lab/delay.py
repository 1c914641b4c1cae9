"""Test-only: a TCP relay that adds a fixed delay each way, the lab's stand-in for ``netem delay`` (our kernel has
no netem).

``python delay.py LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_MS``: every byte read on one side is
written to the other ``DELAY_MS`` after it arrived, in order, without holding back what follows it (a pipe with
latency, not a stop-and-wait). Run it on the store node in front of the store's port: a client reaching the store
through it sees each round trip grow by 2 x ``DELAY_MS``, and every byte still crosses the client's own (shaped,
cut, lossy) link. Connections, bytes and the delay actually applied are printed as one JSON line per closed
connection, so a test can assert that the fault happened.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

READ_BYTES = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float,
                seen: dict[str, float]) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if data is None:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            seen["min_delay_s"] = min(seen.get("min_delay_s", delay_s), loop.time() - (due - delay_s))
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(READ_BYTES):
            seen["bytes"] = seen.get("bytes", 0) + len(data)
            queue.put_nowait((loop.time() + delay_s, data))
    except ConnectionError:
        pass
    finally:
        queue.put_nowait((0.0, None))
        try:
            await sender
        except ConnectionError:
            pass


async def _serve(listen: tuple[str, int], target: tuple[str, int], delay_s: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        started = time.monotonic()
        up: dict[str, float] = {}
        down: dict[str, float] = {}
        try:
            server_r, server_w = await asyncio.wait_for(asyncio.open_connection(*target), 5.0)
        except (OSError, asyncio.TimeoutError):
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, server_w, delay_s, up), _pipe(server_r, client_w, delay_s, down))
        line = {"closed": True, "seconds": round(time.monotonic() - started, 3), "delay_ms": delay_s * 1e3,
                "bytes_to_store": up.get("bytes", 0), "bytes_from_store": down.get("bytes", 0),
                "min_delay_s": round(min(up.get("min_delay_s", delay_s), down.get("min_delay_s", delay_s)), 4)}
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()

    server = await asyncio.start_server(handle, *listen)
    sys.stdout.write(json.dumps({"listening": f"{listen[0]}:{listen[1]}", "target": f"{target[0]}:{target[1]}",
                                 "delay_ms": delay_s * 1e3}) + "\n")
    sys.stdout.flush()
    async with server:
        await server.serve_forever()


def main() -> None:
    host, port, target_host, target_port, delay_ms = sys.argv[1:6]
    asyncio.run(_serve((host, int(port)), (target_host, int(target_port)), float(delay_ms) / 1e3))


if __name__ == "__main__":
    main()
