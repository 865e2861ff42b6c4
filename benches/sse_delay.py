# Measures how long the router holds a server-sent event.
#
#   python3 benches/sse_delay.py ROUTER_PORT BACKEND_PORT
#
# Serves a streaming backend on 127.0.0.1:BACKEND_PORT that writes 400 events 5 ms apart, each
# carrying its send time (CLOCK_MONOTONIC, shared by processes), reads the stream directly and
# through the router (whose backend set must be ["127.0.0.1:BACKEND_PORT"]), and prints the
# percentiles of receive minus send time for both and their difference.
import asyncio, sys, time, json, statistics

EVENTS = 400

async def backend(reader, writer):
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    await writer.drain()
    try:
        for i in range(EVENTS):
            payload = f"data: {time.monotonic_ns()}\n\n".encode()
            writer.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.005)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()

async def client(port):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
    await writer.drain()
    await reader.readuntil(b"\r\n\r\n")
    delays = []
    buffer = b""
    while len(delays) < EVENTS:
        chunk = await reader.read(65536)
        if not chunk:
            break
        now = time.monotonic_ns()
        buffer += chunk
        while b"data: " in buffer and b"\n\n" in buffer:
            start = buffer.index(b"data: ") + 6
            end = buffer.index(b"\n\n", start)
            delays.append((now - int(buffer[start:end])) / 1000)
            buffer = buffer[end + 2:]
    writer.close()
    return delays

def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))]

async def main():
    router_port = int(sys.argv[1])
    server = await asyncio.start_server(backend, "127.0.0.1", int(sys.argv[2]))
    async with server:
        direct = await client(int(sys.argv[2]))
        routed = await client(router_port)
    for name, d in (("direct", direct), ("router", routed)):
        print(f"{name}: n={len(d)} p50={pct(d,50):.0f}us p99={pct(d,99):.0f}us max={max(d):.0f}us")
    print(f"added: p50={pct(routed,50)-pct(direct,50):.0f}us p99={pct(routed,99)-pct(direct,99):.0f}us")

asyncio.run(main())
